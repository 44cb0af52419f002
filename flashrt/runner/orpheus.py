"""Load an Orpheus-style voice: the LM (`flashrt.frontends.lm`), its slot decoder, the SNAC decoder
(`flashrt.load_vocoder`, the vocoder runner), and the chain that joins them
(`flashrt.frontends.orpheus.tts.OrpheusTTS`); and the "orpheus" entry of
`flashrt.frontends.registry.TTS_FAMILIES` (`flashrt.load_tts`).

What Orpheus is (token layout, prompt, frames, speakers) and how a folder is recognised live in
`flashrt.frontends.orpheus`; this module holds the loading because the SNAC decoder is served by the
vocoder runner, which a frontend may not import. The chain's names are re-exported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import flashrt
from flashrt.frontends.lm import load_lm
from flashrt.frontends.orpheus.folder import detect, folder_layout, snac_codebook, snac_folder
from flashrt.frontends.orpheus.layout import load_text_tokenizer
from flashrt.frontends.orpheus.tts import (
    ORPHEUS_SAMPLING,
    OrpheusTTS,
    chunk_plan,
    frame_constraint,
    lm_backend,
    stage_threads,
    to_pcm16,
)
from flashrt.frontends.registry import TtsFamily
from flashrt.runtime.decode import Sampling
from flashrt.runtime.slots import DEFAULT_BATCH_BUCKETS, SlotDecoder

__all__ = ["OrpheusTTS", "load_orpheus", "load_snac", "snac_folder", "detect", "FAMILY", "ORPHEUS_SAMPLING",
           "to_pcm16", "frame_constraint", "chunk_plan", "stage_threads"]

# requests decoded at once by default (K/V cache rows: `describe()['decoder']['model']['cache_bytes']`):
# under load 16 rows kept more first audio in time than 8 on the CPU (docs/benchmarks/serve.md, the
# seventh look), and on a GPU a step costs about the same at 8 and 16 rows
DEFAULT_SLOTS = 16
CPU_MAX_STREAM_CHUNK = 16  # SNAC frames a later stream window decodes at most on a CPU (`load_orpheus`)


def load_orpheus(folder: str | Path, *, snac: str | Path | None = None, device: str = "cpu",
                 precision: str = "fp32", backend: str | None = None, max_new_tokens: int = 1200,
                 cache_len: int = 2048, prompt_buckets: tuple[int, ...] = (32, 64, 128, 256),
                 stream_chunk: int | None = None, max_stream_chunk: int | None = None,
                 frames_per_chunk: int | None = None, queue_size: int = 8,
                 sampling: Sampling = ORPHEUS_SAMPLING, constrain_frames: bool = False,
                 snac_noise: str | None = None, slots: int = DEFAULT_SLOTS,
                 batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS, vocoder: bool = True,
                 lm_graphs: str | None = None, threads: int | str | None = "auto") -> OrpheusTTS:
    """Load the LM (strict), the SNAC decoder (`flashrt.load_vocoder`), capture, and build the chain.

    ``precision`` is the LM's; SNAC decodes in float32, as the reference does. ``stream_chunk``: SNAC
    frames decoded per stream window (each window adds the decoder's context, 3 frames a side at
    24 kHz): fewer means earlier first audio and more decoding; None takes 1 on a GPU (first audio
    after 4 frames, 28 tokens, as Orpheus' own streamer) and 4 on a CPU (the windows cost ~2.5x less
    there). ``max_stream_chunk``: the most frames a later window decodes, the windows growing as the
    stream goes (each as long as the audio already sent: `flashrt.runtime.frontend.ChunkSchedule`), so
    the first audio comes as early and a long request decodes fewer, longer windows; None takes
    ``stream_chunk`` on a GPU (fixed windows, one captured size) and 16 on a CPU.
    ``frames_per_chunk``: frames per code chunk sent from the LM to SNAC (None: as the stream
    windows fall due, `chunk_plan`). ``constrain_frames``: see `frame_constraint` (off: the reference
    samples freely).
    ``snac_noise``: the SNAC decoder's ``noise_mode`` (None: "off", which drops the released decoder's
    noise; "seeded" adds it reproducibly; `flashrt.runner.vocoder`). ``slots``: requests decoded at
    once (rows of the K/V cache; `flashrt.runtime.slots`), with a decode step captured per batch bucket
    in ``batch_buckets`` (and ``slots`` itself). ``vocoder=False``: the LM stage alone, no SNAC decoder
    loaded (the chain's items are the SNAC code chunks, `_Codes`; a served chain split at its stage
    boundary, `flashrt.integrations.ray_serve`, decodes them with `load_snac`). ``lm_graphs``: the graph
    backend of the LM's decode steps (None: ``backend``, or "jit" on the CPU when that is None too:
    `lm_backend`). ``threads``: torch threads per op of each stage (`stage_threads`: "auto", the
    default, shares the cores free at load between the LM and SNAC stages)."""
    folder = Path(folder)
    threads = stage_threads(threads, device, stages=2 if vocoder else 1)
    snac_dir = snac_folder(folder, snac)
    codebook, rate = snac_codebook(snac_dir)
    layout = folder_layout(folder, codebook)
    lm = load_lm(folder, device=device, precision=precision, cache_len=cache_len, batch=slots)
    constraint = frame_constraint(layout) if constrain_frames else None
    decoder = SlotDecoder(lm, prompt_buckets, batch_buckets, max_new_tokens=max_new_tokens,
                          backend=lm_backend(lm_graphs, backend, lm.device),
                          constraint=constraint).capture()
    snac_decoder, stack = (load_snac(snac_dir, device=device, backend=backend, stream_chunk=stream_chunk,
                                     max_stream_chunk=max_stream_chunk, snac_noise=snac_noise, slots=slots)
                           if vocoder else (None, False))
    return OrpheusTTS(decoder, snac_decoder, layout, load_text_tokenizer(folder, layout), sample_rate=rate,
                      frames_per_chunk=frames_per_chunk, queue_size=queue_size,
                      sampling=sampling, stack_windows=stack, threads=threads)


def load_snac(snac_dir: str | Path, *, device: str = "cpu", backend: str | None = None,
              stream_chunk: int | None = None, max_stream_chunk: int | None = None,
              snac_noise: str | None = None, slots: int = DEFAULT_SLOTS) -> tuple[Any, bool]:
    """The SNAC decoder as `load_orpheus` loads it (same options, same meaning) and whether its stream
    windows are stacked as rows of one replay: (vocoder, stack_windows)."""
    cuda = torch.device(device).type == "cuda"
    if stream_chunk is None:
        stream_chunk = 1 if cuda else 4
    if max_stream_chunk is None:
        max_stream_chunk = stream_chunk if cuda else max(stream_chunk, CPU_MAX_STREAM_CHUNK)
    noise = {"noise_mode": snac_noise} if snac_noise is not None else None
    stack = snac_noise in (None, "off")  # seeded noise follows each window's own offset: one row each
    vocoder = flashrt.load_vocoder(snac_dir, device=device, backend=backend, stream_chunk=stream_chunk,
                                   max_stream_chunk=max_stream_chunk, overrides=noise,
                                   batch=slots if stack else 1, stack_windows=stack)
    return vocoder, stack


FAMILY = TtsFamily(
    name="orpheus", detect=detect, load=load_orpheus,
    options=("snac", "max_new_tokens", "cache_len", "prompt_buckets", "stream_chunk", "max_stream_chunk",
             "frames_per_chunk",
             "queue_size", "sampling", "constrain_frames", "snac_noise", "slots", "batch_buckets",
             "lm_graphs", "threads"),
    doc="Orpheus-style LM (Llama/Qwen) emitting SNAC 24 kHz codes, streamed through the SNAC decoder")
