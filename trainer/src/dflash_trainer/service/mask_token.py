"""Preflight's mask-token check: drafter.mask_token_id read against the target's own tokenizer and config.

The id the drafter writes into masked block positions must be one the target never produces as text: a
reserved special token, or an id of the embedding no token uses. An ordinary token (or an added token that is
not special, like Qwen's <think>) would teach the drafter that a real word means "masked", and an id at or
beyond the vocabulary indexes past the embedding. Either is refused naming the id and the token or the
vocabulary size. The files are read as JSON (tokenizer.json, tokenizer_config.json, vocab.json): no
tokenizer library, no model weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


class MaskTokenError(ValueError):
    """The mask id is not usable; the message names the id, the token or vocabulary, and the file."""


@dataclass
class Tokens:
    ordinary: dict[int, tuple[str, str]] = field(default_factory=dict)  # id -> (token, file)
    special: dict[int, tuple[str, str]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MaskTokenError(f"cannot read {path}: {e}") from None


def read_tokens(target: Path) -> Tokens:
    """Every token id the tokenizer files name, ordinary or special."""
    tokens = Tokens()
    tj = target / "tokenizer.json"
    if tj.is_file():
        data = _read(tj)
        tokens.files.append(tj.name)
        vocab = (data.get("model") or {}).get("vocab") or {}
        if isinstance(vocab, dict):
            tokens.ordinary.update({int(i): (t, tj.name) for t, i in vocab.items()})
        elif isinstance(vocab, list):  # unigram: [[token, score], ...] by id
            tokens.ordinary.update({i: (str(entry[0]), tj.name) for i, entry in enumerate(vocab)})
        for added in data.get("added_tokens") or []:
            kind = tokens.special if added.get("special") else tokens.ordinary
            kind[int(added["id"])] = (added["content"], tj.name)
    vj = target / "vocab.json"
    if vj.is_file():
        tokens.files.append(vj.name)
        for t, i in _read(vj).items():
            tokens.ordinary.setdefault(int(i), (t, vj.name))
    tc = target / "tokenizer_config.json"
    if tc.is_file():
        tokens.files.append(tc.name)
        for i, added in (_read(tc).get("added_tokens_decoder") or {}).items():
            kind = tokens.special if added.get("special") else tokens.ordinary
            kind[int(i)] = (added["content"], tc.name)
    for i in tokens.special:  # a special token also listed in a vocabulary is still special
        tokens.ordinary.pop(i, None)
    return tokens


def check_mask_token_id(target: Path, mask_id: int, vocab_size: int) -> str:
    """What the id is; raises MaskTokenError when it is out of the vocabulary or an ordinary token."""
    if not 0 <= mask_id < vocab_size:
        raise MaskTokenError(
            f"drafter.mask_token_id {mask_id} is outside the target's vocabulary of {vocab_size} "
            f"({target / 'config.json'})"
        )
    tokens = read_tokens(target)
    if mask_id in tokens.ordinary:
        token, where = tokens.ordinary[mask_id]
        raise MaskTokenError(
            f"drafter.mask_token_id {mask_id} is the ordinary token {token!r} of {target / where}, "
            "a token the target reads and writes as text"
        )
    if mask_id in tokens.special:
        token, where = tokens.special[mask_id]
        return f"mask token {mask_id} is {token!r}, a special token of {target / where}"
    if not tokens.files:
        return (
            f"mask token {mask_id} < vocabulary {vocab_size} (config.json); {target} has no tokenizer files "
            f"({', '.join(TOKENIZER_FILES)}) to check it against"
        )
    return (
        f"mask token {mask_id} is no token of the tokenizer ({', '.join(tokens.files)}): an unused id of "
        f"the {vocab_size}-entry embedding"
    )


def preflight_check(ctx: Any) -> str:
    """preflight.CHECKS entry (after `model`, which read the target's config)."""
    from dflash_trainer.config import ConfigError, read_target_info
    from dflash_trainer.service.preflight import Failed, Skipped

    cfg = ctx.need_cfg()
    target = cfg.model.target_path
    info = ctx.facts.get("target")
    if info is None:
        try:
            info = read_target_info(target)
        except ConfigError:
            raise Skipped("the target's config.json did not load (see the model check)") from None
    try:
        return check_mask_token_id(target, cfg.drafter.mask_token_id, info.vocab_size)
    except MaskTokenError as e:
        fix = f"set drafter.mask_token_id in {ctx.config_path} to the target tokenizer's reserved mask token"
        raise Failed(str(e), fix) from None
