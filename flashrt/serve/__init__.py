"""`flashrt serve`: an OpenAI-compatible speech server (`flashrt.serve.app`) over `flashrt.load_tts`."""
