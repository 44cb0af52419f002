"""VITS text-to-speech (Piper voices): text -> phonemes -> prior -> flow -> HiFi-GAN -> audio.

    config.py    VitsConfig + presets (piper-medium, piper-high, tiny)
    modules.py   text encoder (relative-position attention), duration predictors, coupling flow
    weights.py   weights from a Piper .onnx (by graph structure) or a VITS training checkpoint
    model.py     VitsPrior, the stage split and the host step (frame_index), load_weights
    decoder.py   VitsDecoder: HiFi-GAN in reused stage buffers, its last stage in cache-sized tiles
    frontend.py  VitsFrontend: buffers, phoneme/frame/window buckets, captured graphs, streaming windows
    phonemes.py  espeak-ng phonemes (piper-tts's bundled espeak), sentence splitting, phoneme ids
    voice.py     VitsVoice (tts(text), tts.stream(text)), find_voice, load_voice
    catalogue.py voices by piper's catalogue names, from local voice folders (search path, layouts)
    family.py    the TTS registry entry ("vits")

The decoder is `VitsDecoder` (decoder.py): the vocoder family's `HifiGan`
(flashrt/frontends/vocoders/hifigan.py) run in reused buffers and tiles.
"""

from flashrt.frontends.vits.config import PRESETS, VitsConfig

__all__ = ["PRESETS", "VitsConfig"]
