"""Text-to-speech family knowledge (prompt templates, token layouts, text tokenizers).

The runners that drive them (`load_tts`, the chain of LM -> frames -> codec) live in `flashrt.runner.tts`.
"""
