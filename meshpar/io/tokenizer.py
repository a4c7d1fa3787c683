"""Text <-> token ids for prompts, outputs and text data. Byte-level (the default): token i is the
byte i (0..255); decoding is UTF-8 with undecodable bytes replaced. `data.tokenizer=PATH`: a Hugging
Face `tokenizers` tokenizer (`HFTokenizer`), with documents packed BOS doc EOS BOS doc EOS ..."""

from __future__ import annotations

import json

from meshpar.core.errors import ConfigError
from meshpar.io import chat as chat_lib


def _byte_of() -> dict:
    """GPT-2's byte-level alphabet (`bytes_to_unicode`) read backwards: character -> byte. Printable
    bytes are themselves; the others are the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(shifted)}


_BYTE_OF = _byte_of()


class ByteTokenizer:
    vocab_size = 256
    eos_id = None  # byte-level text has no end-of-sequence token
    bos_id = None

    def __init__(self, model_vocab: int):
        if model_vocab < 256:
            raise ConfigError(
                f"text prompts use byte tokens 0..255 and need model.vocab >= 256, got {model_vocab}; "
                "give token ids with --prompt-ids instead"
            )

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def prompt(self, text: str) -> list[int]:
        return self.encode(text)

    @staticmethod
    def token_bytes(i: int) -> bytes:
        """The UTF-8 bytes token i stands for: the byte i (a piece of a character, alone)."""
        return bytes([int(i)]) if 0 <= int(i) < 256 else b""

    max_chars_per_token = 1  # a character is one byte or more: a text has at least as many tokens


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (`data.tokenizer`: a tokenizer.json, or a folder that
    holds one). End and beginning of sequence: `eos_token_id`/`bos_token_id` of the folder's
    generation_config.json, else its config.json, else the tokens its tokenizer_config.json names
    (`eos_token`/`bos_token`). `encode` adds no special tokens: prompts get BOS from `prompt`,
    documents BOS and EOS from `document` (a list of EOS ids counts its first). Whether a text gets
    BOS is the tokenizer's word, as in transformers: tokenizer_config.json's `add_bos_token` if it
    says, else none when it names `bos_token: null` (Qwen: its config.json's bos_token_id is not
    prepended), else BOS when one is known. `chat(messages)` renders tokenizer_config.json's
    `chat_template` with jinja2 (sandboxed, as transformers does) and tokenizes the text."""

    def __init__(self, path: str, model_vocab: int | None = None):
        from pathlib import Path

        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ConfigError(f"data.tokenizer '{path}': no tokenizer.json there")
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - not a tokenizers file
            raise ConfigError(
                f"data.tokenizer '{file}' is not a tokenizers JSON file ({str(e).splitlines()[0]})"
            ) from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.byte_level = '"ByteLevel"' in json.dumps(json.loads(self.tok.to_str()).get("decoder"))
        if model_vocab is not None and self.vocab_size > model_vocab:
            raise ConfigError(
                f"data.tokenizer '{file}' has {self.vocab_size} tokens, more than model.vocab={model_vocab}"
            )
        self.config, meta, ends = _special_ids(self.tok, file.parent)  # tokenizer_config.json, BOS/EOS
        self.bos_id, self.eos_id = meta.get("bos"), meta.get("eos")
        self.eos_ids = list(dict.fromkeys(([self.eos_id] if self.eos_id is not None else []) + ends))
        says = self.config.get("add_bos_token", self.config.get("bos_token", "") is not None)  # bos_token: null -> no
        self.add_bos = self.bos_id is not None and bool(says)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    @property
    def max_chars_per_token(self) -> int:
        """An upper bound of the characters one token covers: its longest vocabulary entry (byte-level
        BPE spells each byte as one character, so the decoded text is never longer)."""
        if not hasattr(self, "_max_chars"):
            self._max_chars = max((len(t) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_chars

    def prompt(self, text: str) -> list[int]:
        return ([self.bos_id] if self.add_bos else []) + self.encode(text)

    def chat(self, messages: list[dict], split_special: bool = True) -> list[int]:
        """[{"role", "content"}, ...] -> the ids of tokenizer_config.json's `chat_template` rendered with
        the generation prompt (the template writes any BOS itself). With `split_special`, what a
        message says is text: a special token's text typed inside it (`<|im_end|>`, which would close
        the turn) is tokenized as plain text, the template's own markers stay special, whatever the
        template does with the content (`meshpar.io.chat`)."""
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ConfigError(
                "data.tokenizer has no chat_template in its tokenizer_config.json: drop --chat, or "
                "use the tokenizer of a chat (instruct) model"
            )
        if not split_special:
            return self.tok.encode(chat_lib.render_chat(template, messages, self.config), add_special_tokens=False).ids
        text, spans = chat_lib.layout(template, messages, self.config)
        return chat_lib.tokenize(self.tok, self._plain(), self.special_ids, text, spans)

    def token_bytes(self, i: int) -> bytes:
        """The UTF-8 bytes token i stands for, also when they are a piece of a character that decoding
        it alone turns into U+FFFD: a byte-fallback token `<0xE2>` is that byte, a byte-level BPE token
        (GPT-2's, Llama 3's) maps its characters back to bytes; any other is its decoded text."""
        piece = self.tok.id_to_token(int(i)) or ""
        if int(i) not in self.special_ids:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if self.byte_level and all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([int(i)]).encode()

    def __getstate__(self) -> dict:
        """Pickled (a server's request parser gets its tokenizer so) without the copies made on use: a
        `tokenizers.Tokenizer` pickles without `encode_special_tokens`, so the plain copy would come
        back reading special tokens as special."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_plain_tok", "_max_chars")}

    def _plain(self):
        """A copy of the tokenizer that reads special tokens' text as plain text (made once)."""
        if not hasattr(self, "_plain_tok"):
            from tokenizers import Tokenizer

            self._plain_tok = Tokenizer.from_str(self.tok.to_str())
            self._plain_tok.encode_special_tokens = True
        return self._plain_tok

    def document(self, text: str) -> list[int]:
        """BOS (if the tokenizer has one) + text + EOS (required: it separates packed documents)."""
        if self.eos_id is None:
            raise ConfigError(
                "data.tokenizer has no end-of-sequence token (eos_token_id in generation_config.json "
                "or config.json, or eos_token in tokenizer_config.json beside tokenizer.json): "
                "packed documents need one between them"
            )
        return self.prompt(text) + [self.eos_id]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(data, model_vocab: int):
    """`data.tokenizer` (of `cfg.data`) if set, else the byte-level tokenizer."""
    if data.tokenizer:
        return HFTokenizer(data.tokenizer, model_vocab)
    return ByteTokenizer(model_vocab)


def documents(path: str):
    """The documents of `data.path` for tokenized text: each file of a folder (or the file) is one
    document, except `.jsonl` files, whose lines are documents (their "text" field)."""
    from pathlib import Path

    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    if not files or not files[0].exists():
        raise ConfigError(f"data.path '{path}' has no text files")
    for f in files:
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
                if line.strip():
                    rec = json.loads(line)
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise ConfigError(f"{f}:{i + 1}: a .jsonl document needs a string field 'text'")
                    yield rec["text"]
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def packed_text(path: str, tokenizer: str, model_vocab: int):
    """Every document of `path` tokenized and packed end to end: BOS doc EOS BOS doc EOS ... ->
    (ids [n] uint32, the offsets where documents begin [D] int64)."""
    import numpy as np

    tok = HFTokenizer(tokenizer, model_vocab)
    docs = [tok.document(doc) for doc in documents(path)]
    sizes = np.cumsum([0] + [len(d) for d in docs[:-1]]).astype(np.int64)
    return np.asarray([t for d in docs for t in d], np.uint32), sizes


def _special_ids(tok, folder) -> tuple[dict, dict, list]:
    """The folder's tokenizer_config.json, config.json and generation_config.json (later files win) ->
    (tokenizer_config.json, {"bos", "eos": id}, every end id named: Llama 3 and Gemma 3 chat models
    list their turn ends)."""
    config, meta, ends = {}, {}, []
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        f = folder / name
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        if name == "tokenizer_config.json":
            config = data
        for what in ("bos", "eos"):
            t = data.get(f"{what}_token")
            t = t.get("content") if isinstance(t, dict) else t
            if isinstance(t, str) and tok.token_to_id(t) is not None:
                meta[what] = tok.token_to_id(t)
            v = data.get(f"{what}_token_id")
            if what == "eos":
                ends += [e for e in (v if isinstance(v, list) else [v]) if isinstance(e, int)]
            v = v[0] if isinstance(v, list) and v else v
            if isinstance(v, int):
                meta[what] = v
    return config, meta, ends
