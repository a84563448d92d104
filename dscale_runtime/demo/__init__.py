"""The embedded demo pair: a small Qwen3 code model and its DFlash drafter, built from the stdlib's source."""
