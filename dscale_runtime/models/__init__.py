"""Qwen3 target and DFlash drafter models and their checkpoint loader."""
