"""Benchmark: the Orpheus-style chain (flashrt) against transformers `generate` + the `snac` package, on
the same random checkpoint folder, CPU, batch 1.

Regime: one utterance at a time of exactly ``--frames`` SNAC frames (7 tokens each; decoding is
constrained to the code valid at each place of a frame on both sides, because random weights emit no
valid frames; the constraint is one mask per step), Orpheus' sampling (temperature 0.6, top-p 0.8,
repetition penalty 1.3), ``--threads`` torch threads for both. Sizes ``--size``: "small" = a Llama 512
wide x 4 layers (8 heads, 2 kv, mlp 1536) over Orpheus' vocabulary (156,940 ids, tied head) + SNAC
24 kHz as released; "tiny" = the test fixture's miniature sizes. The folder is written here by
transformers ``save_pretrained`` and snac, and flashrt reads it with ``flashrt.load_tts`` like a
downloaded checkpoint. Run it in the reference venv (transformers, snac), with flashrt on the path:

    OMP_NUM_THREADS=1 PYTHONPATH=. HF_HUB_OFFLINE=1 /work/ref/venv/bin/python bench/tts_orpheus.py \\
        --size small --frames 24 --pairs 4

Metrics per utterance, A/B interleaved (alternating order) in one process, medians:

* TTFA: from the call to the first audio sample in hand. flashrt: the first chunk of ``tts.stream``
  (SNAC windows of 4 frames + the decoder's 3-frame right context). transformers: Orpheus' own streaming
  rule (decoder.py: the first audio is the 4-frame window after 28 tokens), i.e. the time generate takes
  to its 28th token plus one SNAC decode of 4 frames.
* total / RTF: the whole utterance to the last sample / audio duration. transformers: generate, then
  one SNAC decode of every frame.
* tokens/s of the LM alone; flashrt's per-stage service times (chain LatencyStats).

The first utterance of each side (warm-up) is timed apart. Prints a table on stderr, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

TEXT = "Hello there, how are you today?"
SIZES = {
    "small": dict(vocab_size=156940, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, snac="24khz", base=128256),
    "tiny": dict(vocab_size=720, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, snac="tiny", base=258),
}


def write_folder(folder: Path, size: str, seed: int) -> dict:
    """A random Orpheus-style folder: transformers LlamaForCausalLM + snac/ (+ orpheus.json for tiny)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashrt.frontends.vocoders import get_family
    from flashrt.testing.synthetic.vocoders import write_snac

    spec = dict(SIZES[size])
    snac_preset, base = spec.pop("snac"), spec.pop("base")
    torch.manual_seed(seed)
    cfg = LlamaConfig(**spec, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    codebook = 4096 if size == "small" else 64
    snac_cfg = replace(get_family("snac").presets[snac_preset], noise=False, codebook_size=codebook)
    write_snac(snac_cfg, folder / "snac", seed + 1)
    if size == "tiny":
        (folder / "orpheus.json").write_text(json.dumps(
            {"text_tokenizer": "bytes", "base_vocab": base, "bos_token_id": 256, "eot_token_id": 257}))
    else:  # a byte stand-in for Llama-3's tokenizer.json (not shipped here); ids are valid text ids
        (folder / "orpheus.json").write_text(json.dumps({"text_tokenizer": "bytes"}))
    return {"codebook": snac_cfg.codebook_size}


class Reference:
    """transformers generate (frame-constrained, Orpheus sampling) + snac decode, Orpheus' streaming rule."""

    def __init__(self, folder: Path, layout, frames: int):
        from snac import SNAC
        from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

        self.model = LlamaForCausalLM.from_pretrained(folder).eval()
        self.snac = SNAC.from_pretrained(str(folder / "snac")).eval()
        self.layout, self.frames = layout, frames
        ref = self

        class Frames(LogitsProcessor):
            def __call__(self, input_ids, scores):
                k = input_ids.shape[1] - ref.prompt_len
                if k == 28:
                    ref.t28 = time.perf_counter()
                lo = layout.audio_base + (k % 7) * layout.codebook_size
                mask = torch.full_like(scores, -torch.inf)
                mask[:, lo:lo + layout.codebook_size] = 0
                return scores + mask

        self.processors = LogitsProcessorList([Frames()])

    def codes(self, tokens: list[int]) -> list[torch.Tensor]:
        lay = self.layout
        codes = [t - lay.audio_base - (k % 7) * lay.codebook_size for k, t in enumerate(tokens)]
        frames = [codes[i:i + 7] for i in range(0, len(codes), 7)]
        levels = ([f[0] for f in frames], [x for f in frames for x in (f[1], f[4])],
                  [x for f in frames for x in (f[2], f[3], f[5], f[6])])
        return [torch.tensor([lv]) for lv in levels]

    def run(self, prompt: list[int], seed: int) -> dict:
        torch.manual_seed(seed)
        ids = torch.tensor([prompt])
        self.prompt_len, self.t28 = ids.shape[1], None
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=0.6, top_p=0.8, repetition_penalty=1.3,
                                      max_new_tokens=7 * self.frames, min_new_tokens=7 * self.frames,
                                      logits_processor=self.processors, pad_token_id=0)
            generated = time.perf_counter()
            codes = self.codes(out[0, ids.shape[1]:].tolist())
            t0 = time.perf_counter()
            self.snac.decode([c[:, :4 * c.shape[1] // self.frames] for c in codes])  # first 4-frame window
            first_window = time.perf_counter() - t0
            audio = self.snac.decode(codes)
        total = time.perf_counter() - start
        tokens = out.shape[1] - ids.shape[1]
        return {"ttfa_ms": ((self.t28 or generated) - start + first_window) * 1e3,
                "total_ms": (total - first_window) * 1e3, "samples": audio.shape[-1],
                "tokens_per_s": tokens / (generated - start)}


def run_flashrt(tts, seed: int) -> dict:
    from flashrt.frontends.orpheus.tts import ORPHEUS_SAMPLING

    chunks = list(tts.stream(TEXT, voice="tara", seed=seed, sampling=ORPHEUS_SAMPLING))
    r = tts.report()
    return {"ttfa_ms": r["ttfa_ms"], "total_ms": r["total_ms"], "samples": sum(c.shape[0] for c in chunks),
            "tokens_per_s": r["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import flashrt

    with tempfile.TemporaryDirectory(prefix="flashrt-orpheus-") as tmp:
        folder = Path(tmp) / "orpheus"
        write_folder(folder, args.size, seed=0)
        start = time.perf_counter()
        tts = flashrt.load_tts(folder, constrain_frames=True, max_new_tokens=7 * args.frames, cache_len=512,
                               prompt_buckets=(64,))
        load_ms = (time.perf_counter() - start) * 1e3
        ref = Reference(folder, tts.layout, args.frames)
        prompt = tts.prompt_ids(TEXT, "tara")
        warm = {"flashrt": run_flashrt(tts, 0), "transformers": ref.run(prompt, 0)}
        rows: dict[str, list[dict]] = {"flashrt": [], "transformers": []}
        for i in range(args.pairs):
            order = ("flashrt", "transformers") if i % 2 == 0 else ("transformers", "flashrt")
            for side in order:
                rows[side].append(run_flashrt(tts, i + 1) if side == "flashrt" else ref.run(prompt, i + 1))
        stages = {k: v["service_ms"] for k, v in tts.report()["stages"].items()}
        tts.close()
    audio_s = rows["flashrt"][0]["samples"] / tts.sample_rate
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("ttfa_ms", "total_ms", "tokens_per_s")}
           for side, rs in rows.items()}
    for side in med:
        med[side]["rtf"] = med[side]["total_ms"] / 1e3 / audio_s
    result = {"bench": "tts-orpheus-vs-transformers", "size": args.size, "frames": args.frames,
              "audio_s": audio_s, "threads": args.threads, "pairs": args.pairs, "flashrt_load_ms": load_ms,
              "median": med, "warmup": warm,
              "ttfa_ratio": med["transformers"]["ttfa_ms"] / med["flashrt"]["ttfa_ms"],
              "total_ratio": med["transformers"]["total_ms"] / med["flashrt"]["total_ms"],
              "flashrt_stages_p50_ms": {k: v["p50"] for k, v in stages.items()},
              "flashrt_stages_items": {k: v["count"] for k, v in stages.items()}}
    for side, m in med.items():
        print(f"{side:13} TTFA {m['ttfa_ms']:8.1f} ms  total {m['total_ms']:8.1f} ms  RTF {m['rtf']:.3f}  "
              f"{m['tokens_per_s']:6.1f} tok/s  (warm-up TTFA {warm[side]['ttfa_ms']:.1f} ms)",
              file=sys.stderr)
    print(f"ratios transformers/flashrt: TTFA {result['ttfa_ratio']:.2f}x, "
          f"total {result['total_ratio']:.2f}x; flashrt stage p50 ms {result['flashrt_stages_p50_ms']}",
          file=sys.stderr)
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
