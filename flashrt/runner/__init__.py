"""Runners: call patterns over frontends that know no model (the policy runner, the stream runner, the
TTS runners). The AR decode runner (prefill buckets + one decode step replayed per token, sampling on
the device) lives one layer down, in `flashrt.runtime.decode` / `flashrt.runtime.sampling`, because
a frontend (Pi0-FAST) composes it.

`flashrt.runner.policy` `Policy` (infer / step / reset over a `PolicyFrontend`) and `load_policy`;
`flashrt.runner.stream` one-shot + streaming decode over a
`StreamFrontend` (held partial frames, context windows); `flashrt.runner.vocoder` the vocoder families
behind it (`load_vocoder`); `flashrt.runner.orpheus` loads the Orpheus-style TTS chain (LM -> frames
-> SNAC; the family's knowledge and its chain live in `flashrt.frontends.orpheus`), a `load_tts` family
(`flashrt.runner.tts`, `flashrt.frontends.registry.TTS_FAMILIES`).
"""
