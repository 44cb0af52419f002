"""Model families: one folder per family (config, weights, model, frontend)."""
