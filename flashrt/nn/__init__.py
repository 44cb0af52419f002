"""Shared neural-network blocks of the frontends: norms, RoPE, static-K/V attention, Gemma, SigLIP, audio."""
