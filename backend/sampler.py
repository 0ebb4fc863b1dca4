"""Logits of the sampling rows → next tokens (and their logprobs), each row with its own parameters."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Sequence

import torch

from kvyard.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """One row to sample: its parameters, RNG and the token history the penalties look at."""
    params: SamplingParams
    generator: torch.Generator | None  # None when greedy
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    allowed: torch.Tensor | None = None  # [ceil(V / 32)] int32 from a grammar: bit t % 32 of word t // 32
                                         # set = token t may come next; None = every token may
    suppressed: Sequence[int] = ()       # ids that may not come next (eos and stop tokens before min_new_tokens)


@dataclass
class Sample:
    token_id: int
    logprob: float | None                            # when params.logprobs
    top_logprobs: list[tuple[int, float]] | None     # most likely first, when top_logprobs > 0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sample]:
    """logits: [S, V] float32, one row per SampleRow; rows with `allowed` are masked in place (the engine
    hands over a tensor of its own). Logprobs are the model's (after penalties and bias), before the mask:
    a grammar decides what may be picked, not how likely the model found it."""
    logits = _apply_penalties_and_bias(logits, rows)
    want_logprobs = any(r.params.logprobs or r.params.top_logprobs for r in rows)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # before temperature
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if constrained:
        _apply_masks(logits, rows, constrained)
    token_list = _pick(logits, rows)
    for i in constrained:
        if not _is_allowed(rows[i].allowed, token_list[i]):
            token_list[i] = _repick(logits[i:i + 1], rows[i])

    out: list[Sample] = []
    for i, (row, token) in enumerate(zip(rows, token_list)):
        lp = top = None
        if logprobs is not None and (row.params.logprobs or row.params.top_logprobs):
            lp = float(logprobs[i, token])
            if row.params.top_logprobs:
                vals, idx = logprobs[i].topk(row.params.top_logprobs)
                top = list(zip(idx.tolist(), vals.tolist()))
        out.append(Sample(token, lp, top))
    return out


def _apply_penalties_and_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    touched = [i for i, r in enumerate(rows) if _needs_history(r.params) or _bans(r) or r.params.logit_bias]
    if not touched:
        return logits
    logits = logits.clone()
    for i in touched:
        p = rows[i].params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(rows[i].prompt_ids) | set(rows[i].output_ids)),
                                dtype=torch.long, device=row.device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and rows[i].output_ids:
            ids = torch.tensor(list(rows[i].output_ids), dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            idx = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row[idx] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
        banned = _banned(rows[i])
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
        if p.allowed_token_ids:
            keep = torch.full_like(row, float("-inf"))
            idx = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)
            keep[idx] = row[idx]
            row.copy_(keep)
    return logits


def _bans(row: SampleRow) -> bool:
    return bool(row.suppressed or row.params.bad_words_ids or row.params.allowed_token_ids)


def _banned(row: SampleRow) -> list[int]:
    """Ids this row may not pick next: suppressed ones, and the last id of each bad word whose other ids
    the output ends with. Logprobs are taken after this (as after logit_bias): a banned token shows -inf."""
    out = list(row.suppressed)
    history = row.output_ids
    for word in row.params.bad_words_ids:
        head = word[:-1]
        if not head or (len(history) >= len(head) and tuple(history[len(history) - len(head):]) == head):
            out.append(word[-1])
    return out


def _apply_masks(logits: torch.Tensor, rows: Sequence[SampleRow], constrained: list[int]) -> None:
    """Tokens a row's grammar does not allow → -inf, in place; the other rows keep every bit."""
    masks = torch.stack([rows[i].allowed for i in constrained])  # type: ignore[misc]  # [C, W] int32
    kernels = _cpu_kernels(logits)
    if kernels is not None and logits.is_contiguous() and masks.device.type == "cpu":
        kernels.mask_rows_(logits, torch.tensor(constrained, dtype=torch.long), masks)
        return
    V = logits.shape[1]
    bits = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64), torch.arange(32)).to(torch.int32)
    masks = masks.to(logits.device)
    keep = (masks.unsqueeze(-1) & bits.to(logits.device)) != 0       # [C, W, 32]
    keep = keep.view(len(constrained), -1)[:, :V]                      # [C, V]
    if keep.shape[1] < V:                                               # a mask shorter than the vocabulary
        keep = torch.nn.functional.pad(keep, (0, V - keep.shape[1]), value=False)
    idx = torch.tensor(constrained, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))


def _is_allowed(mask: torch.Tensor | None, token: int) -> bool:
    if mask is None:
        return True
    word = token // 32
    return word < mask.shape[0] and bool((int(mask[word]) >> (token % 32)) & 1)


def _repick(logits: torch.Tensor, row: SampleRow) -> int:
    """The C++ draw clamps exponents at e^-87, so a masked token keeps ~1e-38 of mass: a pick that lands
    there (about once in 10^33 draws) is drawn again in PyTorch, where softmax gives -inf exactly 0."""
    if row.params.greedy:
        token = int(logits[0].argmax())
    else:
        token = int(_draw(logits, [row])[0])
    if not _is_allowed(row.allowed, token):
        raise ValueError("the grammar allows no token here")
    return token


def _pick(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """One token per row: greedy rows their argmax, the others a draw. On a CPU with the C++ kernels,
    every row without a top_k/top_p/min_p filter goes through one kernel call (greedy or inverse CDF,
    one pass over the row); filtered rows, and everything elsewhere, through _draw."""
    kernels = _cpu_kernels(logits)
    filtered = [i for i, r in enumerate(rows) if not r.params.greedy and (_filters(r.params) or _bans(r))]
    if kernels is None or len(filtered) == len(rows):
        tokens = logits.argmax(dim=-1)
        drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
        if drawn:
            tokens[drawn] = _draw(logits[drawn], [rows[i] for i in drawn])
        return tokens.tolist()
    plain = [i for i in range(len(rows)) if i not in set(filtered)]
    temps = torch.tensor([0.0 if rows[i].params.greedy else rows[i].params.temperature for i in plain])
    u = torch.tensor([0.0 if rows[i].params.greedy else torch.rand(1, generator=rows[i].generator).item()
                      for i in plain])
    picked = kernels.sample_rows(logits if len(plain) == len(rows) else logits[plain], temps, u).tolist()
    if min(picked) < 0:
        raise ValueError("sampling met non-finite logits")
    out = [0] * len(rows)
    for i, token in zip(plain, picked):
        out[i] = token
    if filtered:
        for i, token in zip(filtered, _draw(logits[filtered], [rows[i] for i in filtered]).tolist()):
            out[i] = token
    return out


def _cpu_kernels(logits: torch.Tensor) -> ModuleType | None:
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    from backend import kernels
    return kernels.load()


def _filters(p: SamplingParams) -> bool:
    return bool(p.top_k) or p.min_p > 0 or p.top_p < 1.0 or p.typical_p < 1.0


def _needs_history(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _draw(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """logits: [R, V] of rows that sample → one token each, after temperature, top_k, min_p, top_p.
    Batched over the rows (one softmax, one cumsum); each row's randomness comes from its own generator,
    one uniform draw, so a seeded request gets the same tokens whatever else is in the batch.
    Inverse-CDF sampling: the first token whose cumulative mass exceeds u * total."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    for j, row in enumerate(rows):
        p = row.params
        if _filters(p):
            probs[j] = _filter(probs[j], p)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sampling met non-finite or all-zero probabilities")
    u = torch.cat([torch.rand(1, generator=r.generator, device=logits.device) for r in rows])
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return picks.clamp_(max=probs.shape[1] - 1)


def _filter(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """probs: [V] after temperature → the same with tokens outside top_k, min_p, typical_p and top_p set to 0."""
    if p.top_k and p.top_k < probs.shape[0]:
        kth = probs.topk(p.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.typical_p < 1.0:
        # Locally typical sampling: rank tokens by how far their surprisal is from the entropy; keep the
        # closest until they hold typical_p of the mass (the closest always survives).
        q = probs / probs.sum()
        logq = torch.log(q.clamp_min(1e-38))
        entropy = -(q * logq).sum()
        order = (-logq - entropy).abs().masked_fill(q == 0, float("inf")).argsort()
        mass = q[order]
        drop = (mass.cumsum(0) - mass) >= p.typical_p
        probs = probs.scatter(0, order, probs[order].masked_fill(drop, 0.0))
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token when the mass before it is < top_p of the total: the top token always survives.
        total = sorted_probs.sum()
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p * total
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
