"""A stand-in for Kimi-K2's tokenizer, built from a test world's byte-level BPE: the same kind of folder
(`tiktoken.model` ranks, a tokenizer class in the folder named by `auto_map`, so loading it needs
trust_remote_code) and the same kind of tokenizer (a slow, python one over tiktoken: no offset mapping).
Kimi's own cannot be downloaded here; this one has the properties regraft must handle."""
from __future__ import annotations

import base64
import json
from pathlib import Path

# The tokenizer class the folder carries (its "remote code"), over tiktoken with the GPT-2 split pattern that a
# byte-level BPE pre-tokenizer uses, so the ids equal the source tokenizer's.
TOKENIZER_CODE = '''
import base64
from pathlib import Path

import tiktoken
from transformers import PreTrainedTokenizer

SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""


class TiktokenStandIn(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, special_token_ids=None, **kwargs):
        ranks = {}
        for line in Path(vocab_file).read_text().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        self.special_token_ids = dict(special_token_ids or {})
        self.encoding = tiktoken.Encoding("standin", pat_str=SPLIT, mergeable_ranks=ranks,
                                          special_tokens=self.special_token_ids)
        self.id_to_bytes = {rank: token for token, rank in ranks.items()}
        self.id_to_bytes.update({rank: token.encode() for token, rank in self.special_token_ids.items()})
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.id_to_bytes)

    def get_vocab(self):
        return {self._convert_id_to_token(rank): rank for rank in self.id_to_bytes}

    def _tokenize(self, text, **kwargs):
        return [self._convert_id_to_token(rank) for rank in self.encoding.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        if token in self.special_token_ids:
            return self.special_token_ids[token]
        return self.encoding.encode_single_token(bytes.fromhex(token))

    def _convert_id_to_token(self, index):
        token = self.id_to_bytes[index]
        return token.decode() if index in self.special_token_ids.values() else token.hex()

    def convert_tokens_to_string(self, tokens):
        pieces = [token.encode() if token in self.special_token_ids else bytes.fromhex(token) for token in tokens]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE's printable stand-in character for each byte (GPT-2's mapping), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + shifted)] = byte
            shifted += 1
    return characters


def build(fast_dir: Path, out: Path, specials: list[str], added: tuple[str, ...] = ()) -> Path:
    """A tiktoken tokenizer folder with the ids of the byte-level BPE in `fast_dir`; `added` special tokens take the
    ids after its vocab (as Kimi's media tokens follow its ranks)."""
    vocab = json.loads((fast_dir / "tokenizer.json").read_text())["model"]["vocab"]
    alphabet = byte_level_alphabet()
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(bytes(alphabet[c] for c in token)).decode()} {rank}"
             for token, rank in sorted(vocab.items(), key=lambda item: item[1]) if token not in specials]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (out / "tokenization_standin.py").write_text(TOKENIZER_CODE)
    source = json.loads((fast_dir / "tokenizer_config.json").read_text())
    config = {"auto_map": {"AutoTokenizer": ["tokenization_standin.TiktokenStandIn", None]},
              "tokenizer_class": "TiktokenStandIn", "chat_template": (fast_dir / "chat_template.jinja").read_text(),
              "special_token_ids": {**{token: vocab[token] for token in specials},
                                    **{token: len(vocab) + index for index, token in enumerate(added)}},
              "eos_token": source.get("eos_token"), "pad_token": source.get("pad_token"),
              "additional_special_tokens": [t for t in specials if t not in (source.get("eos_token"),
                                                                             source.get("pad_token"))] + list(added)}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out
