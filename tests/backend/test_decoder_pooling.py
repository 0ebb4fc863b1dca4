"""Decoders as pooling models (backend/decoder_pooling.py) against sentence-transformers and transformers on
the same weights: a tiny random Qwen3-Embedding-style embedder (last-token pooling, normalised, a query
prompt) and Qwen3 / Llama *ForSequenceClassification scorers, float32 within 2e-3."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend.decoder_pooling import DecoderPoolingModel
from backend.engine_types import PoolingRequest, PoolItem, PoolTask
from backend.pooling import run_task
from backend.pooling_engine import PoolingEngine
from backend.step_threads import EXPLORE_EVERY, EXPLORE_MAX, SMALL_STEP_TOKENS, StepThreads
from kvyard.pooling_model import ModelKind, load_pooling_spec
from tests.backend.test_encoder import SENTENCES, _batch, _tokenizer, _values
from tests.support.tiny_decoder_poolers import QUERY_PROMPT, tiny_decoder_pooler

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ATOL = 2e-3
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoder_pooler(tmp_path_factory.mktemp("qwen3-embedding"))


def test_qwen3_embedder_matches_sentence_transformers(qwen3_embedder: Path) -> None:
    from sentence_transformers import SentenceTransformer
    spec = load_pooling_spec(qwen3_embedder)
    assert (spec.kind, spec.pooling, spec.normalize, spec.max_len, spec.is_decoder) == \
        (ModelKind.EMBED, "last", True, 128, True)
    assert spec.prompts["query"] == QUERY_PROMPT
    model = DecoderPoolingModel(spec, torch.float32, CPU)
    st = SentenceTransformer(str(qwen3_embedder), device="cpu")
    tok = _tokenizer(qwen3_embedder)
    for texts, prompt in ((SENTENCES, ""), (SENTENCES[:3], QUERY_PROMPT), (SENTENCES[4:5], "")):
        ours = _values(run_task(model, PoolTask.EMBED, *_batch(tok, [prompt + t for t in texts])))
        theirs = torch.from_numpy(st.encode(texts, prompt=prompt, batch_size=4))
        assert ours.shape == theirs.shape == (len(texts), 128)
        assert torch.allclose(ours, theirs, atol=ATOL), (ours - theirs).abs().max()
        assert F.cosine_similarity(ours, theirs).min() >= 0.9999


def test_a_batch_pools_each_input_as_alone(qwen3_embedder: Path) -> None:
    """Inputs of different lengths share one step (one-token inputs are decode rows): each answer is the
    one it gets alone, and the scratch cache grows as a longer step needs."""
    model = DecoderPoolingModel(load_pooling_spec(qwen3_embedder), torch.float32, CPU)
    engine = PoolingEngine(model, "emb", max_num_seqs=8, max_num_batched_tokens=4096)
    items = [PoolItem([5]), PoolItem(list(range(10, 50))), PoolItem([7, 8, 9]), PoolItem(list(range(3, 120)))]
    engine.add(PoolingRequest("r", items, PoolTask.EMBED))
    together = engine.step()[0].outputs
    for item, pooled in zip(items, together):
        engine.add(PoolingRequest("one", [item], PoolTask.EMBED))
        alone = engine.step()[0].outputs[0]
        assert torch.allclose(torch.tensor(pooled.values), torch.tensor(alone.values), atol=1e-5)


@pytest.mark.parametrize("family, num_labels", [("qwen3", 3), ("llama", 1)])
def test_sequence_classifier_logits_match_transformers(tmp_path: Path, family: str, num_labels: int) -> None:
    import transformers
    path = tiny_decoder_pooler(tmp_path / family, family=family, num_labels=num_labels)
    spec = load_pooling_spec(path)
    assert (spec.kind, spec.pooling, len(spec.labels)) == (ModelKind.CLASSIFY, "last", num_labels)
    assert (spec.kind.a, ModelKind.EMBED.a) == ("a classify model", "an embed model")  # the messages' wording
    tok = _tokenizer(path)
    ids, types, mask = _batch(tok, SENTENCES[:4], ["a second text"] * 4)
    ours = _values(run_task(DecoderPoolingModel(spec, torch.float32, CPU), PoolTask.CLASSIFY, ids, types, mask))
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    pad = ref.config.pad_token_id
    with torch.no_grad():  # padded with the pad token, as transformers expects
        logits = ref(input_ids=ids.masked_fill(~mask, pad), attention_mask=mask.long()).logits
    assert ours.shape == logits.shape == (4, num_labels)
    assert torch.allclose(ours, logits, atol=ATOL), (ours - logits).abs().max()


def test_qwen3_causal_lm_logits_match_transformers(tmp_path: Path) -> None:
    """Qwen3's q/k norms serve chat too: every position's logits of one prefill."""
    import transformers
    from backend.model import LlamaModel
    from backend.weights import load_weights
    from kvyard.model_config import load_model_config
    from tests.backend.conftest import full_logits
    from tests.support.tiny_decoder_poolers import decoder_config
    from tests.support.tiny_models import randomize
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(decoder_config("qwen3", 300, 0, tie_word_embeddings=False))
    randomize(ref)
    ref.eval().save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    assert (config.architecture, config.qk_norm, config.attention_bias) == ("qwen3", True, False)
    model = LlamaModel(config, load_weights(tmp_path, config, torch.float32, CPU))
    ids = [(7 * i + 3) % 300 for i in range(40)]
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    ours = full_logits(model, config, ids)
    assert torch.allclose(ours, theirs, atol=ATOL), (ours - theirs).abs().max()


def test_small_and_large_steps_choose_their_thread_counts_apart(qwen3_embedder: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step of at most SMALL_STEP_TOKENS padded tokens runs on one torch thread, the first larger
    one on all, the second small one on all (its chooser's first try of them); the engine thread's count is
    restored after each."""
    import backend.pooling_engine as pooling_engine
    threads: list[int] = []

    def recording(*args: object) -> list:
        threads.append(torch.get_num_threads())
        return run_task(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pooling_engine, "run_task", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    engine = PoolingEngine(DecoderPoolingModel(load_pooling_spec(qwen3_embedder), torch.float32, CPU), "emb", 8, 4096)
    try:
        for n in (5, SMALL_STEP_TOKENS + 1, 5):
            engine.add(PoolingRequest(f"r{n}", [PoolItem(list(range(3, 3 + n)))], PoolTask.EMBED))
            assert len(engine.step()[0].outputs) == 1
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert threads == [1, 2, 2]


def test_large_steps_run_on_the_thread_count_measured_faster() -> None:
    """Each count is tried once (all threads first), then the faster runs, the other tried after
    EXPLORE_EVERY large steps, the wait doubling after each try it loses (up to EXPLORE_MAX) and reset when
    it wins; a count that turns slow loses its place. (The chooser of small steps tries one thread first.)"""
    chooser = StepThreads(2)
    assert StepThreads(2, first=1).choose() == 1 and StepThreads(1).choose() == 1

    def run(seconds: dict[int, float], steps: int) -> list[int]:
        picks = []
        for _ in range(steps):
            picks.append(chooser.choose())
            chooser.measured(picks[-1], seconds[picks[-1]])
        return picks

    n = EXPLORE_EVERY
    # a busy machine: one thread is faster; all threads tried again after n large steps, then after 2n
    assert run({1: 1.0, 2: 3.0}, 3 * n) == [2] + [1] * (n - 2) + [2] + [1] * (2 * n - 1) + [2]
    # the machine quietens: the next try of all threads (after 4n) wins and they stay, one thread tried after n
    assert run({1: 1.0, 2: 0.2}, 4 * n) == [1] * (4 * n - 1) + [2]
    assert run({1: 1.0, 2: 0.2}, 2 * n) == [2] * (n - 1) + [1] + [2] * n
    # however long one count keeps losing, it is tried again within EXPLORE_MAX large steps
    picks = run({1: 1.0, 2: 0.2}, 4 * EXPLORE_MAX)
    tries = [i for i, t in enumerate(picks) if t == 1]
    assert [b - a for a, b in zip(tries, tries[1:])] == [4 * n] + [EXPLORE_MAX] * 3
