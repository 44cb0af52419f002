"""The Pi0-FAST policy family: `FAMILY` (detect -> load) and `Pi0FastPolicyFrontend`, the
`flashrt.runtime.frontend.PolicyFrontend` that the model-agnostic `Policy` runner drives.

    check(obs, noise)      observation -> images checked (the Pi0 family's preprocessing), state
                           normalized and discretized into the prompt, prompt ids + bos, the decode
                           runner's bucket and limits checked. Nothing written. Pi0-FAST decodes
                           greedily: a caller's noise is refused.
    write(bucket, c, seed) images into the model's static buffers; the prompt ids go to the decode
                           runner's own step buffers at the start of the replay
    replay(bucket)         the prefill graph of that bucket, then the ONE decode graph replayed per token
                           (`flashrt.runtime.decode.Decoder`: greedy pick on the device, the graph feeds
                           itself), until the end marker "|" or max_decoding_steps
    read(c)                the FAST detokenizer (`fast.py`), un-normalization, relative dims made absolute

Stop detection: the host reads the generated ids every ``sync_every`` tokens and stops at "|". Cost:
one device->host read of k ids per k tokens, and at most k - 1 decode steps past the marker (computed,
never used). Default k = 1 on the CPU (a read there costs ~microseconds, a wasted step a whole step)
and 8 on CUDA (a sync drains the queue of graph launches; 8 wasted steps at most).

Prompt (lerobot 0.6.1 `Pi0FastPrepareStateAndLanguageTokenizerProcessorStep` + `TokenizerProcessorStep`):
``[bos] + encode(f"Task: {cleaned task}, State: {bins};\\n")`` with the normalized state discretized into
256 bins as for Pi0.5; then the model appends bos (`PI0FastPytorch.sample_actions_fast_kv_cache`). A
prompt longer than the reference's ``max_length`` is refused (InputError), never silently cut.

The chunk has ``n_action_steps`` rows: lerobot decodes the FAST stream into (n_action_steps, action_dim).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.pi0.checkpoint import relative_offset
from flashrt.frontends.pi0.frontend import default_buckets
from flashrt.frontends.pi0.observation import check_state, split_observation
from flashrt.frontends.pi0.preprocess import CheckedImage, ImagePreprocessor
from flashrt.frontends.pi0.tokenizer import PaliGemmaTokenizer, clean_prompt, discretize_state
from flashrt.frontends.pi0_fast.checkpoint import Pi0FastCheckpoint, load_checkpoint
from flashrt.frontends.pi0_fast.checkpoint import detect as detect_dir
from flashrt.frontends.pi0_fast.fast import Detokenizer, FastTokenizer, TextIds
from flashrt.frontends.pi0_fast.model import Pi0FastDecodeModel
from flashrt.ops.decoder import decoder_prefer
from flashrt.quant.precision import compute_dtype
from flashrt.runtime.decode import Decoder, Sampling
from flashrt.runtime.device import resolve_device
from flashrt.runtime.frontend import PolicyFamily

__all__ = ["FAMILY", "Pi0FastPolicyFrontend", "Pi0FastChecked", "load", "detect", "prompt_ids"]


def prompt_ids(tok: PaliGemmaTokenizer, task: Any, state_norm: torch.Tensor, max_len: int) -> list[int]:
    """The reference's prompt ids (module docstring), without the bos the model appends."""
    if not isinstance(task, str):
        raise InputError(f"prompt must be a string, got {type(task).__name__}")
    bins = " ".join(map(str, discretize_state(state_norm)))
    ids = tok.encode(f"Task: {clean_prompt(task)}, State: {bins};\n", bos=True)
    if len(ids) > max_len:
        raise InputError(f"prompt is {len(ids)} tokens with the state, longer than the checkpoint's "
                         f"{max_len}; shorten it")
    return ids


@dataclass(frozen=True)
class Pi0FastChecked:
    """One validated observation: images, prompt ids (with the trailing bos), raw state."""

    images: Mapping[str, CheckedImage]
    ids: torch.Tensor
    state: torch.Tensor


class Pi0FastPolicyFrontend:
    """A loaded Pi0-FAST checkpoint behind the policy-frontend verbs (module docstring)."""

    batches = (1,)  # one observation per replay (`Policy.infer_batch` runs them in turn)
    cannot_batch = ("Pi0-FAST decodes its action tokens autoregressively, one sequence per captured "
                    "decode step")

    def __init__(self, checkpoint: Pi0FastCheckpoint, model: Pi0FastDecodeModel, decoder: Decoder,
                 tokenizer: PaliGemmaTokenizer, detokenizer: Detokenizer, sync_every: int) -> None:
        self.checkpoint, self.model, self.decoder = checkpoint, model, decoder
        self.tokenizer, self.detokenizer, self.sync_every = tokenizer, detokenizer, int(sync_every)
        self.images = ImagePreprocessor(checkpoint.cameras, checkpoint.resolution)
        self.device, self.buffers = model.device, model.buffers
        self.state_dim, self.action_dim = checkpoint.state_dim, checkpoint.action_dim
        self.chunk_size = self.n_action_steps = checkpoint.n_action_steps
        self.max_steps = checkpoint.model_config.max_decoding_steps
        self.end_id = detokenizer.text.end
        self.tokens: list[int] = []
        self._sampling = Sampling(temperature=checkpoint.temperature)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.decoder.buckets

    # ------------------------------------------------------------------------------ hot path
    def check(self, obs: Mapping[str, Any], noise: Any = None) -> tuple[int, Pi0FastChecked]:
        if noise is not None:
            raise InputError("Pi0-FAST decodes its action tokens greedily: it takes no noise")
        o = split_observation(obs, self.checkpoint.rename_map)
        images = self.images.check(o.images)
        state = check_state(o.state, self.state_dim)
        ids = prompt_ids(self.tokenizer, o.prompt, self.checkpoint.state_norm.normalize(state),
                         self.checkpoint.max_prompt_len)
        bucket, checked_ids, _ = self.decoder.check([*ids, self.tokenizer.bos_id], self.max_steps,
                                                    self._sampling)
        return bucket, Pi0FastChecked(images, checked_ids, state)

    def write(self, bucket: int, checked: Pi0FastChecked, seed: int | None = None) -> None:
        bufs = self.buffers
        self.images.write(checked.images, bufs["vision_images"][0], bufs["vision_masks"][0])
        self._pending = checked.ids
        if seed is not None:
            self._sampling = Sampling(temperature=self.checkpoint.temperature, seed=int(seed) & 0xFFFFFFFF)

    def replay(self, bucket: int) -> None:
        self.tokens = list(self.decoder.generate(self._pending, self.max_steps, stop=(self.end_id,),
                                                 sampling=self._sampling, sync_every=self.sync_every))

    def read(self, checked: Pi0FastChecked) -> np.ndarray:
        actions = torch.from_numpy(self.detokenizer.decode(self.tokens))
        actions = self.checkpoint.action_norm.unnormalize(actions)
        if self.checkpoint.relative_mask is not None:
            actions = actions + relative_offset(self.checkpoint.relative_mask, checked.state, self.action_dim)
        return actions.numpy().astype(np.float32, copy=False)

    # ------------------------------------------------------------------------------ reporting
    def describe(self) -> dict[str, Any]:
        return {"family": "pi0_fast", **self.checkpoint.summary(), **self.decoder.describe(),
                "device": str(self.device), "sync_every": self.sync_every, "batches": list(self.batches),
                "cannot_batch": self.cannot_batch}

    def report(self) -> dict[str, Any]:
        """The decode runner's counters: captures per decode mode (never grow after load), replays,
        the prefill buckets' captures and fallbacks, and the last request (tokens, why it ended)."""
        return self.decoder.report()


# ---------------------------------------------------------------------------------- loading
def _text_ids(tok: PaliGemmaTokenizer) -> TextIds:
    sp = tok._sp
    end = sp.piece_to_id("|")
    if end == sp.unk_id():
        raise CheckpointError(f"tokenizer {tok.path} has no '|' piece (Pi0-FAST's end-of-action marker)")
    return TextIds(vocab_size=tok.vocab_size, end=end, action_prefix=tuple(tok.encode("Action: ")),
                   action_start=(sp.piece_to_id("Action"), sp.piece_to_id(":")))


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def load(path: str | Path, device: str | torch.device = "cpu", precision: str | torch.dtype = "float32",
         num_steps: int | None = None, backend: str | None = None, buckets: Sequence[int] | None = None,
         tokenizer: str | Path | None = None, action_tokenizer: str | Path | None = None,
         sync_every: int | None = None, kernels: str = "auto") -> Pi0FastPolicyFrontend:
    """Load a lerobot pi0_fast policy dir and capture its prefill buckets and decode step.
    ``num_steps`` overrides max_decoding_steps (the tokens generated at most). ``kernels`` (the
    "decoder" ops of `flashrt.ops.decoder`): the Gemma's norms, RoPE and GeGLU products, prefill and
    decode step; "auto" is the fused csrc kernels on a CUDA device where they build, else the ATen
    references, as for Pi0 (the one `flashrt.ops.select` pass at load, ``describe()["ops"]``)."""
    from flashrt.frontends.pi0_fast.weights import load_pi0_fast

    dev = resolve_device(device)
    decoder_prefer(kernels)  # an unknown choice fails before anything loads
    ck = load_checkpoint(path, tokenizer=tokenizer, action_tokenizer=action_tokenizer)
    if num_steps is not None:
        ck = _with_steps(ck, _positive("num_steps", num_steps))
    tok = PaliGemmaTokenizer(ck.tokenizer_path)
    if tok.vocab_size != ck.model_config.vlm.vocab_size:
        raise CheckpointError(f"tokenizer {tok.path} has {tok.vocab_size} pieces, the model's vocabulary "
                              f"{ck.model_config.vlm.vocab_size}: the FAST id mapping needs them equal")
    detok = Detokenizer(FastTokenizer.load(ck.fast_path), _text_ids(tok), ck.model_config.fast_skip_tokens,
                        ck.n_action_steps, ck.action_dim, ck.check_prefix)
    net = load_pi0_fast(ck.model_config, ck.weights, device=dev, dtype=compute_dtype(precision),
                        kernels=kernels)
    sizes = tuple(buckets) if buckets else default_buckets(ck.max_prompt_len + 1)
    steps = ck.model_config.max_decoding_steps
    model = Pi0FastDecodeModel(net, len(ck.cameras), max(sizes) + steps, dev)
    # greedy checkpoints (temperature 0, lerobot's default) rank one candidate in the prefill's shared
    # sampling branch instead of a top-1024 over the whole vocabulary (milliseconds per token on a CPU)
    candidates = 1 if ck.temperature == 0 else 1024
    decoder = Decoder(model, sizes, max_new_tokens=steps, backend=backend, candidates=candidates,
                      penalty=False).capture()  # lerobot's action-token decode has no repetition penalty
    k = _positive("sync_every", sync_every) if sync_every is not None else (1 if dev.type == "cpu" else 8)
    return Pi0FastPolicyFrontend(ck, model, decoder, tok, detok, k)


def _with_steps(ck: Pi0FastCheckpoint, steps: int) -> Pi0FastCheckpoint:
    from dataclasses import replace

    return replace(ck, model_config=ck.model_config.replace(max_decoding_steps=steps))


def detect(path: Path) -> None:
    """None for a lerobot pi0_fast policy dir; CheckpointError saying why not otherwise."""
    detect_dir(path)


FAMILY = PolicyFamily(
    name="pi0_fast", detect=detect, load=load,
    options=("tokenizer", "action_tokenizer", "sync_every", "kernels"),
    doc="Pi0-FAST (lerobot 0.6.1 pi0_fast policy dirs): PaliGemma emitting FAST action tokens, greedy "
        "decode with one captured decode step")
