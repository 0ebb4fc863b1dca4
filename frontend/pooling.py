"""The pooling pipeline (frontend/embeddings.py's routes call it): which model → tokenize (the model's own
tokenizer, special tokens, pairs for cross-encoders, the context check or truncation; frontend/token_bound.py
first, so a text of megabytes is not tokenized whole) → route (the master by model name, else the pooling
backend) → PoolCall → plain numbers for the route to shape."""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from tokenizers import Encoding, Tokenizer

from frontend.backend_client import PoolInput, PoolOutput
from frontend.config import FrontendConfig
from frontend.off_loop import off_loop
from frontend.routing import ROUTER_PLACEHOLDER_MODEL, Router
from frontend.token_bound import cut_after, cut_at, more_words, words_are_tokens
from kvyard.disconnect import cancel_on_disconnect
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_POOL_ITEMS
from kvyard.pooling_model import QWEN3_RERANKER, ModelKind, PoolingSpec
from kvyard.tokenizer import pooling_tokenizer

# A text whose words alone are more than LONG × the context is refused untokenized; a truncated one is
# tokenized up to LONG × what the cut keeps. Under that it is tokenized whole, so the 400 counts its tokens.
LONG = 2


@dataclass(frozen=True)
class PoolingModel:
    """The pooling model this frontend serves."""
    name: str
    spec: PoolingSpec
    tokenizer: Tokenizer            # padding and truncation off: we decide both
    backend_address: str            # without a master
    bounded: bool = False           # words_are_tokens(tokenizer): refuse and cut by words before tokenizing


class PoolingPipeline:
    def __init__(self, cfg: FrontendConfig, router: Router) -> None:
        self.cfg = cfg
        self.router = router
        self.model: PoolingModel | None = None
        if cfg.embedding is not None:
            tok = pooling_tokenizer(cfg.embedding.path)
            tok.no_padding()
            tok.no_truncation()
            self.model = PoolingModel(cfg.embedding_model_name, cfg.embedding, tok, cfg.embedding_backend_address,
                                      words_are_tokens(tok))

    # --- which model ---

    def resolve(self, requested: str | None, route: str, kinds: tuple[ModelKind, ...], head: str = "") -> PoolingModel:
        """The model a pooling route was asked for; a 400 naming the kind when it cannot answer this route."""
        own = self.model
        if own is not None and not self.cfg.generates and self.cfg.serves(requested or ""):
            requested = own.name  # an alias of CHECKPOINT_PATH's pooling model
        if requested and requested != ROUTER_PLACEHOLDER_MODEL and (own is None or requested != own.name):
            if self.cfg.serves(requested):
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"model {requested!r} is a {ModelKind.GENERATE} "
                                   f"model: it cannot answer {route}" + self._other(), "model")
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"The model {requested!r} does not exist; this server's "
                               f"pooling model is {own.name!r}" if own else f"The model {requested!r} does not "
                               "exist; this server serves no pooling model", "model")
        if own is None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"model {self.cfg.model_name!r} is a "
                               f"{ModelKind.GENERATE} model: it cannot answer {route}; this server serves no pooling "
                               "model (EMBEDDING_MODEL_PATH)", "model")
        if own.spec.kind not in kinds or (head and not own.spec.has_head(head)):
            heads = f" (heads: {', '.join(own.spec.heads)})" if own.spec.kind is ModelKind.EMBED else ""
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"model {own.name!r} is {own.spec.kind.a}{heads}: it cannot "
                               f"answer {route}", "model")
        return own

    def _other(self) -> str:
        return f"; this server's pooling model is {self.model.name!r}" if self.model else ""

    # --- tokenize ---

    async def tokenize(self, model: PoolingModel, texts: list[str | list[int] | tuple[str, str]],
                       truncate: int | None, prompt: str = "", param: str = "input",
                       cut_with: str = "truncate_prompt_tokens", instruction: str | None = None) -> list[PoolInput]:
        """Texts (with the prompt before each), token ids as given, or (text, text) pairs → inputs within
        the model's context: longer is a 400 unless `truncate` (truncate_prompt_tokens; -1 = the context).
        param: the request field the texts came from, which errors name; cut_with: what the too-long error
        tells the client to pass (the route's own way of asking for a cut); instruction: a templated model's
        (Qwen3-Reranker's `<Instruct>`) in place of its default, a 400 for a model whose prompt has none."""
        if instruction is not None and not model.spec.template:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"model {model.name!r} takes no instruction (only a "
                               "reranker with an instruction prompt, such as Qwen3-Reranker, does)", "instruction")
        if not texts:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} is empty", param)
        if len(texts) > MAX_POOL_ITEMS:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"at most {MAX_POOL_ITEMS} inputs per request, got "
                               f"{len(texts)}", param)
        limit = model.spec.max_len
        if truncate is not None:
            if truncate > limit:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"truncate_prompt_tokens {truncate} is past this "
                                   f"model's context ({limit} tokens)", "truncate_prompt_tokens")
            if truncate == 0:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, "truncate_prompt_tokens 0 keeps no tokens: give at "
                                   "least 1, or -1 for the model's context", "truncate_prompt_tokens")
            limit = limit if truncate == -1 else truncate
        return await off_loop(self._tokenize, model, texts, limit, truncate is not None, prompt, param, cut_with,
                              instruction)

    def _tokenize(self, model: PoolingModel, texts: list[str | list[int] | tuple[str, str]], limit: int,
                  cut: bool, prompt: str, param: str, cut_with: str, instruction: str | None) -> list[PoolInput]:
        tok = model.tokenizer
        vocab = tok.get_vocab_size(with_added_tokens=True)
        plain = not cut and not model.spec.template and all(isinstance(t, str) for t in texts)
        batch = iter(_encode_texts(tok, [prompt + t for t in texts if isinstance(t, str)], limit, model.bounded)) \
            if plain else None
        out: list[PoolInput] = []
        for i, text in enumerate(texts):
            encoded: PoolInput | None
            if batch is not None:
                encoded = next(batch)
            elif isinstance(text, list):  # token ids, as given
                if any(not 0 <= t < vocab for t in text):
                    raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} {i}: token ids must be in [0, {vocab})",
                                       param)
                encoded = PoolInput(text[:limit] if cut else text)
            elif model.spec.template:
                if not isinstance(text, tuple):
                    raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} {i}: model {model.name!r} scores (query, "
                                       "document) pairs with its prompt: give [query, document] pairs", param)
                encoded = _encode_templated(tok, *text, limit, cut, model.bounded, instruction)
            else:
                first, second = (text if isinstance(text, tuple) else (prompt + text, None))
                encoded = _encode(tok, first, second, limit, cut, model.bounded)
            if encoded is None:  # its words alone are too many
                raise _too_long(param, i, f"more than {LONG * limit}", limit, cut_with)
            out.append(encoded)
            if not out[-1].token_ids:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{param} {i} has no tokens", param)
            if len(out[-1].token_ids) > limit and cut:  # cut to what it cannot lose: special tokens, a template
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"truncate_prompt_tokens {limit} is too few for {param} "
                                   f"{i}: its special tokens (and prompt template) alone take "
                                   f"{len(out[-1].token_ids)}", "truncate_prompt_tokens")
            if len(out[-1].token_ids) > limit:
                raise _too_long(param, i, str(len(out[-1].token_ids)), limit, cut_with)
        return out

    # --- run ---

    async def run(self, request: Request, model: PoolingModel, inputs: list[PoolInput], task: str) -> PoolOutput:
        """The PoolCall, cancelled when the client disconnects (which aborts its inputs in the backend)."""
        return await cancel_on_disconnect(request, self.router.pool(
            f"pool-{uuid.uuid4().hex}", inputs, task, model.name, (model.backend_address,),
            self.cfg.request_timeout_s or None))


def _too_long(param: str, i: int, tokens: str, limit: int, cut_with: str) -> RequestError:
    return RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, f"{param} {i} has {tokens} tokens; this model's maximum "
                        f"context length is {limit} tokens (pass {cut_with} to cut it)", param)


def _encode(tok: Tokenizer, first: str, second: str | None, limit: int, cut: bool, bounded: bool) -> PoolInput | None:
    """With the model's special tokens; with `cut`, past `limit` as the tokenizers library's longest-first
    truncation cuts (_longest_first). bounded (PoolingModel.bounded): each text is tokenized only a little past
    what the cut keeps (_sides); uncut texts whose words alone are more than LONG × limit tokens are not
    tokenized at all: None."""
    specials = tok.post_processor.num_special_tokens_to_add(second is not None) if tok.post_processor is not None else 0
    room = max(0, limit - specials)
    if bounded and not cut and more_words([first] if second is None else [first, second], LONG * limit - specials):
        return None
    a, b = _sides(tok, first, second, room, LONG * room if bounded and cut else None)
    if cut:
        la, lb = _longest_first(len(a.ids), len(b.ids) if b is not None else 0, room)
        a = _kept(tok, first, a, la, bounded)
        b = _kept(tok, second, b, lb, bounded) if second is not None and b is not None else None
    enc: Encoding = tok.post_process(a, b, add_special_tokens=True)
    pair_start = enc.type_ids.index(1) if b is not None and 1 in enc.type_ids else 0
    if b is not None and not pair_start:  # a tokenizer without segment ids (XLM-R): after the first text's end
        pair_start = next((j for j, s in enumerate(enc.sequence_ids) if s == 1), 0)
    return PoolInput(enc.ids, pair_start)


def _encode_texts(tok: Tokenizer, texts: list[str], limit: int, bounded: bool) -> list[PoolInput | None]:
    """Single texts, uncut, each as _encode tokenizes it, in one encode_batch (the library's own threads, no
    Python per text): 32 sentences of 20-60 words in ~1.2 ms against ~3 ms one by one. None for a text whose
    words alone are too many (bounded, as _encode), which is not tokenized."""
    specials = tok.post_processor.num_special_tokens_to_add(False) if tok.post_processor is not None else 0
    too_long = [bounded and more_words([t], LONG * limit - specials) for t in texts]
    encoded = iter(tok.encode_batch([t for t, long in zip(texts, too_long) if not long], add_special_tokens=True))
    return [None if long else PoolInput(next(encoded).ids) for long in too_long]


def _kept(tok: Tokenizer, text: str, enc: Encoding, n: int, bounded: bool) -> Encoding:
    """enc cut to its first n tokens. Encoding.truncate keeps the rest as overflowing pieces of n tokens, and
    post_process then builds every pair of the two sides' pieces (a pair of 15,000-token texts cut to ~100
    each: 3.8 s); bounded (token_bound), the text is first re-encoded up to the word boundary after token n,
    whose tokens are the whole text's first ones, so at most a word's tokens overflow."""
    if bounded and 0 < n < len(enc.ids):
        enc = tok.encode(cut_at(text, enc.offsets[n - 1][1]), add_special_tokens=False)
    enc.truncate(n)
    return enc


def _longest_first(la: int, lb: int, room: int) -> tuple[int, int]:
    """The lengths a pair of la and lb tokens is cut to within `room`, as the tokenizers library's longest_first
    truncation cuts them (what transformers' fast tokenizers, so sentence-transformers' CrossEncoder, run): the
    shorter side whole when it takes at most half the room and the longer the rest, else half the room each with
    an odd token to the longer side (to the second on a tie)."""
    if la + lb <= room:
        return la, lb
    short = min(la, lb)
    short, longer = (short, room - short) if 2 * short <= room else (room // 2, room - room // 2)
    return (longer, short) if la > lb else (short, longer)


def _sides(tok: Tokenizer, first: str, second: str | None, room: int,
           words: int | None) -> tuple[Encoding, Encoding | None]:
    """The texts' tokens without special tokens. words: each text only up to a cut past that many words (its
    first tokens, token_bound.cut_after), widened until the cut cannot change what _longest_first keeps of a
    pair: which side is the longer, where half the room each leaves an odd token."""
    while True:
        ta = first if words is None else cut_after(first, words)
        tb = second if words is None or second is None else cut_after(second, words)
        a = tok.encode(ta, add_special_tokens=False)
        b = tok.encode(tb, add_special_tokens=False) if tb is not None else None
        if b is None or words is None or ta is first and tb is second:
            return a, b
        la, lb = len(a.ids), len(b.ids)  # at most the whole texts' lengths (the first tokens of each)
        if ta is first and lb > la or tb is second and la > lb or room % 2 == 0 and 2 * min(la, lb) > room:
            return a, b
        words *= 4


def _encode_templated(tok: Tokenizer, query: str, document: str, limit: int, cut: bool, bounded: bool,
                      instruction: str | None = None) -> PoolInput | None:
    """Qwen3-Reranker's prompt, tokenized as its model card does: the prefix, the instruction-query-document
    text and the suffix each on their own, without special tokens; with `cut`, past `limit` the middle is cut
    at its end. instruction: the request's, else the card's default. bounded: as _encode, for the middle."""
    t = QWEN3_RERANKER
    prefix = tok.encode(t["prefix"], add_special_tokens=False).ids
    suffix = tok.encode(t["suffix"], add_special_tokens=False).ids
    text = t["pair"].format(instruction=t["instruction"] if instruction is None else instruction, query=query,
                            document=document)
    room = max(0, limit - len(prefix) - len(suffix))
    if bounded and cut:
        text = cut_after(text, LONG * room)
    elif bounded and more_words([text], LONG * limit - len(prefix) - len(suffix)):
        return None
    middle = tok.encode(text, add_special_tokens=False).ids
    return PoolInput(prefix + (middle[:room] if cut else middle) + suffix)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]
