"""Runners: call patterns over frontends that know no model (the policy runner, the AR decode runner,
the stream runner, the TTS runners).

`flashrt.runner.policy` `Policy` (infer / step / reset over a `PolicyFrontend`) and `load_policy`;

`flashrt.runner.decode` prefill buckets + one decode step replayed per token; `flashrt.runner.sampling`
token selection on the device (both re-exported from `flashrt.runtime`, where frontends may compose
them); `flashrt.runner.stream` one-shot + streaming decode over a
`StreamFrontend` (held partial frames, context windows); `flashrt.runner.vocoder` the vocoder families
behind it (`load_vocoder`); `flashrt.runner.orpheus` the Orpheus-style TTS chain (LM -> frames -> SNAC),
a `load_tts` family (`flashrt.runner.tts`, `flashrt.frontends.registry.TTS_FAMILIES`).
"""
