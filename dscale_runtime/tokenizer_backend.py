"""The Rust tokenizer behind a transformers fast tokenizer, where calling it directly gives the wrapper's results.

Torch-free: the server's HTTP process (`server/app.py` through `server/detokenize.py`) imports it.
"""

from __future__ import annotations


def rust_tokenizer(tokenizer, encode: bool = False):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, where calling it gives what the wrapper's
    `decode(ids, skip_special_tokens=True)` (and with `encode`, `encode(text, add_special_tokens=False)`) gives:
    the wrapper overrides neither method nor the fast class's `_decode` / `_encode_plus`, cleans up no spaces, and
    (for encoding) the backend has no truncation, padding or special-token splitting of its own, which the
    wrapper's call would have switched off. The backend skips the wrapper's argument handling and takes batches
    on its own threads (`encode_batch`, `decode_batch`). None for any other tokenizer: use its methods."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # NOTE: a tokenizer from elsewhere keeps its own methods
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    backend = tokenizer.backend_tokenizer
    if encode and not (cls.encode is PreTrainedTokenizerBase.encode
                       and cls._encode_plus is PreTrainedTokenizerFast._encode_plus
                       and backend.truncation is None and backend.padding is None
                       and not getattr(backend, "encode_special_tokens", False)
                       and not getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend
