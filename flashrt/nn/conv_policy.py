"""Which algorithm each `flashrt.nn.audio.Conv1d` of a loaded model runs on the CPU: a named policy,
applied once after load (``load_vocoder(conv=...)``; each vocoder family names its default).

Policies (`POLICIES`):

* ``direct``: oneDNN's direct convolution everywhere.
* ``auto``: block-spectral GEMMs for the wide convs where they measured faster (`SpectralPolicy`,
  `flashrt.nn.spectral_conv`), Winograd F(4, 3) for the 3-tap convs at 128-256 channels
  (`flashrt.nn.winograd_conv`), oneDNN for the rest. Fastest; the result of a sample may depend (at the
  1e-7 level) on the length of the sequence and where it starts, because the spectral blocks, the
  Winograd tiles and oneDNN's dilated kernels are laid out from the start of the sequence.
* ``invariant``: every conv adds in an order that does not depend on the sequence's length or start:
  oneDNN's undilated direct conv (measured position-invariant); dilated convs as undilated convs over
  the (T/d, d) view (`Conv1d.phase_split`); transposed convs as one stride-1 conv over all output
  phases (`ConvTranspose1d.polyphase`). oneDNN's dilated and transposed kernels are not
  position-invariant. A streamed window then computes each sample exactly as the one-shot run does:
  stream == one-shot bit for bit. BigVGAN's default: its snake activations amplify rounding
  differences through ~90 convs to 1e-5 and more (fp32's own floor for that network: the reference
  package is 9e-6 from float64), so only equal arithmetic keeps its stream within 1e-5 of the one-shot
  output. Costs time on the dilated convs (docs/benchmarks/vocoders.md) and 1.5x the upsamplers' FLOPs.
* ``spectral``: every eligible conv spectral (tests and comparisons).

Spectral convs apply to float32 CPU models, the invariant forms to CPU models of any dtype; on a GPU
every conv stays cuDNN's whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from flashrt.nn.spectral_conv import MIN_BLOCKS, SpectralPolicy, eligible
from flashrt.nn.winograd_conv import winograd_eligible

__all__ = ["ConvPolicy", "POLICIES", "apply_conv_policy", "conv_forms"]


@dataclass(frozen=True)
class ConvPolicy:
    """``spectral``: which convs go block-spectral (None: none); ``invariant``: dilated convs phase-split;
    ``winograd``: 3-tap convs at `WIDTHS` channels as Winograd F(4, 3) (`flashrt.nn.winograd_conv`)."""

    spectral: SpectralPolicy | None = None
    invariant: bool = False
    winograd: bool = False


POLICIES: dict[str, ConvPolicy] = {
    "direct": ConvPolicy(),
    "auto": ConvPolicy(spectral=SpectralPolicy(), winograd=True),
    "invariant": ConvPolicy(invariant=True),
    "spectral": ConvPolicy(spectral=SpectralPolicy(every=True)),
}


def apply_conv_policy(module: nn.Module, policy: ConvPolicy) -> dict[str, list[str]]:
    """Set every Conv1d of ``module`` per ``policy`` (re-applying another policy undoes the previous
    one). Returns the names of the convs made spectral, phase-split, polyphase (upsamplers) and
    Winograd."""
    from flashrt.nn.audio import Conv1d, ConvTranspose1d

    chosen: dict[str, list[str]] = {"spectral": [], "phase_split": [], "polyphase": [], "winograd": []}
    for name, conv in module.named_modules():
        if not isinstance(conv, (Conv1d, ConvTranspose1d)):
            continue
        invariant = policy.invariant and conv.weight.device.type == "cpu"
        if isinstance(conv, ConvTranspose1d):
            conv.set_polyphase(invariant)
            chosen["polyphase"] += [name] if invariant else []
            continue
        out_ch, in_ch, taps = conv.weight.shape
        spectral = policy.spectral is not None and eligible(conv)
        plans = policy.spectral.blocks(taps, in_ch, out_ch, conv.dilation[0]) if spectral else ()
        block, min_blocks = plans[0] if plans else (None, MIN_BLOCKS)
        conv.phase_split = invariant and conv.can_phase_split()
        conv.set_spectral(block, min_blocks, plans[1] if len(plans) > 1 else None)  # also packs the weight
        conv.set_winograd(policy.winograd and not invariant and block is None and winograd_eligible(conv))
        chosen_forms = (("spectral", block is not None), ("phase_split", conv.phase_split),
                        ("winograd", conv.winograd is not None))
        for key, on in chosen_forms:
            if on:
                chosen[key].append(name)
    return chosen


def conv_forms(module: nn.Module) -> dict[str, int]:
    """How many of ``module``'s convs run each form now (what `apply_conv_policy` chose): Conv1d
    "spectral", "winograd", "phase_split" or "direct"; ConvTranspose1d "polyphase" or "transposed"."""
    from flashrt.nn.audio import Conv1d, ConvTranspose1d

    counts: dict[str, int] = {}
    for conv in module.modules():
        if isinstance(conv, ConvTranspose1d):
            form = "polyphase" if conv.polyphase else "transposed"
        elif isinstance(conv, Conv1d):
            form = ("spectral" if conv.spectral is not None else "winograd" if conv.winograd is not None
                    else "phase_split" if conv.phase_split else "direct")
        else:
            continue
        counts[form] = counts.get(form, 0) + 1
    return dict(sorted(counts.items()))
