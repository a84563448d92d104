"""DScale runtime: models, KV cache, engine (DFlash and DScale decoding)."""
