"""Pi0-FAST: PaliGemma emitting FAST action tokens, decoded greedily with one captured decode step.

    policy = flashrt.load_policy("path/to/pi0fast_dir", tokenizer="path/to/tokenizer.model")

`family` (registry entry, `Pi0FastPolicyFrontend`), `checkpoint` (lerobot 0.6.1 pi0_fast dirs), `model`
(`Pi0FastNet`, `Pi0FastDecodeModel` for `flashrt.runtime.decode.Decoder`), `weights`, `fast` (the FAST
detokenizer), `config`. Preprocessing, the PaliGemma tokenizer and normalization are the Pi0 family's.
"""
