"""Pi0 / Pi0.5 (PaliGemma + Gemma action expert, flow matching)."""
