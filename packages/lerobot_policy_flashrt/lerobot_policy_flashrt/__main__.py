"""``python -m lerobot_policy_flashrt CHECKPOINT OUT [--device D] [--precision P] [--tokenizer T]
[--embodiment E]``: a folder for ``--policy.path`` (what lerobot-rollout takes): the ``flashrt``
config naming CHECKPOINT, and the pass-through processors. No weights are copied."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lerobot_policy_flashrt.configuration_flashrt import FlashRTConfig
from lerobot_policy_flashrt.processor_flashrt import make_flashrt_pre_post_processors


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m lerobot_policy_flashrt", description=__doc__)
    parser.add_argument("checkpoint", help="a flashrt policy folder, or a hub id in the local cache")
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--embodiment", default=None)
    args = parser.parse_args(argv)
    checkpoint = os.path.abspath(args.checkpoint) if os.path.exists(args.checkpoint) else args.checkpoint
    config = FlashRTConfig(checkpoint=checkpoint, device=args.device, precision=args.precision,
                           tokenizer=args.tokenizer, embodiment=args.embodiment)
    args.out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.out)
    for pipeline in make_flashrt_pre_post_processors(config):
        pipeline.save_pretrained(args.out)
    return args.out


if __name__ == "__main__":
    main()
