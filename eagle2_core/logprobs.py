"""Log-probabilities of emitted tokens, and their OpenAI shapes.

A token's log-probability is read from the processed scores that decided it: greedy, the
log-softmax of the scores after every processor (temperature 1: greedy runs no warper);
sampling, of the scores after the warpers and any mask, the distribution the token was drawn
from. Under speculation the scores are those of the verify row (the tree node) whose logits
decided the token, so where the target's products are row-invariant (CPU block targets in int8
or exact) they are bitwise the scores plain decoding computes for that token. Nothing here runs
unless a request asks for logprobs. No terminal code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # OpenAI's ceiling on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # the most likely tokens, most likely first, finite logprobs only


def token_logprobs(scores: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per token: row r of `scores` [n, V] (processed scores) decided tokens[r]."""
    out = []
    for r, t in enumerate(tokens):
        # row by row: a row's log-softmax is then the same bits whatever rows a verify had beside it
        lp = torch.log_softmax(scores[r].float(), -1)
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            vals, ids = torch.topk(lp, min(top, lp.numel()))
            best = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()) if v != float("-inf"))
        out.append(TokenLogprob(int(t), float(lp[t]), best))
    return out


# -- OpenAI's shapes ------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from bytes to the printable characters byte-level BPE vocabularies spell them with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenText:
    """Each token's bytes and text as OpenAI reports them: `bytes` the token's own UTF-8 bytes
    (a token may hold part of a character: the bytes of consecutive tokens join into the text),
    `token` those bytes as text, with \\xNN escapes for bytes that are not whole characters."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.byte_level = self._byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    @staticmethod
    def _byte_level(tokenizer) -> dict | None:
        """GPT-2's byte-to-character table inverted, where `tokenizer` spells tokens in it (byte-level BPE), else None."""
        try:
            pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a tokenizer without these calls: decode token by token
            return None
        if not pieces or not pieces[0].startswith("\u0120"):
            return None
        return {c: b for b, c in _bytes_to_unicode().items()}

    def _bytes(self, token: int) -> bytes:
        if token not in self.special:
            piece = self.tok.convert_ids_to_tokens(token)
            if isinstance(piece, str):
                if self.byte_level is not None and all(c in self.byte_level for c in piece):
                    return bytes(self.byte_level[c] for c in piece)
                if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece's byte fallback
                    try:
                        return bytes([int(piece[3:5], 16)])
                    except ValueError:
                        pass
                if self.byte_level is None and "\u2581" in piece:  # SentencePiece's word boundary
                    return piece.replace("\u2581", " ").encode("utf-8")
        return self.tok.decode([token], skip_special_tokens=False).encode("utf-8")

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self.cache.get(token)
        if got is None:
            raw = self._bytes(token)
            got = self.cache[token] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return got


def token_text(tokenizer) -> TokenText:
    """`tokenizer`'s TokenText, made once per tokenizer (its spellings are cached in it)."""
    got = getattr(tokenizer, "_eagle2_token_text", None)
    if got is None:
        got = TokenText(tokenizer)
        try:
            tokenizer._eagle2_token_text = got
        except AttributeError:
            pass
    return got


def chat_entry(e: TokenLogprob, text: TokenText) -> dict:
    """One token in chat's shape: `choice.logprobs.content[i]`."""
    token, raw = text(e.token)
    top = []
    for t, lp in e.top:
        s, b = text(t)
        top.append({"token": s, "logprob": lp, "bytes": b})
    return {"token": token, "logprob": e.logprob, "bytes": raw, "top_logprobs": top}


def chat_content(entries: list[TokenLogprob], text: TokenText) -> list[dict]:
    return [chat_entry(e, text) for e in entries]


def completion_logprobs(entries: list[TokenLogprob], text: TokenText, offsets: list[int]) -> dict:
    """Completions' shape: {tokens, token_logprobs, top_logprobs, text_offset}; `offsets` the
    character offset of each token in the completion's text."""
    tops = []
    for e in entries:
        d: dict[str, float] = {}
        for t, lp in e.top:
            d.setdefault(text(t)[0], lp)  # two tokens with one spelling: the likelier is listed first
        tops.append(d)
    return {"tokens": [text(e.token)[0] for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": list(offsets)}
