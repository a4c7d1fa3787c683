"""Text <-> token ids for prompts and outputs. Byte-level: token i is the byte i (0..255), the
tokenizer of `data.kind=text`; decoding is UTF-8 with undecodable bytes replaced."""
from __future__ import annotations

from meshpar.errors import ConfigError


class ByteTokenizer:
    vocab_size = 256
    eos_id = None       # byte-level text has no end-of-sequence token

    def __init__(self, model_vocab: int):
        if model_vocab < 256:
            raise ConfigError(f"text prompts use byte tokens 0..255 and need model.vocab >= 256, got {model_vocab}; "
                              "give token ids with --prompt-ids instead")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
