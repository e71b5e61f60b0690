"""Recipe ``embed`` (sentence embeddings, the multiple-negatives ranking loss) on the shipped STS-B pairs.

In process (default suite): pooling equals sentence-transformers' ``Pooling`` on the shared all-MiniLM-L6-v2 folder
(mean, normalized, read from its ``modules.json``) and the recipe's loss equals sentence-transformers'
``MultipleNegativesRankingLoss`` and its symmetric form on the same embeddings; the gradient cache
(``train.embed.cached``) gives the plain loss and gradients with dropout on (its second pass draws the first pass's
masks); a repeated text is no negative of itself (``train.embed.mask_duplicates``: the loss of the candidates with
the copies removed); Spearman and retrieval metrics against SciPy and a direct count; every bad input as one line
naming file, row and column.

Launched (extended: 4 launches of ``tests/configs/parity_embed.yaml``, 2 CPU ranks, micro-batch 4 x accumulation 2):
the negatives gathered across ranks at ZeRO 0 and ZeRO 3, and the gradient cache at ZeRO 2, each against one device
running every anchor of a group (a micro-step's rows of both ranks; with the cache the whole global batch) against
every positive of it in one forward, a copy of its own positive left out (the runs' seed puts one in a group):
losses 1e-5, grad norms 1e-4 / 1e-5, exported weights 1e-5 at ZeRO 3; the step-0 evaluation against
sentence-transformers' ``SentenceTransformer`` on the same weights; a resume from step 3 that repeats steps 4-6; the
export loaded by ``SentenceTransformer`` embedding as the engine did.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from conftest import (REPO, assert_one_device, assert_resume_repeats, cpu_env, lazy_runs, one_refusal, read_metrics,
                      refusals)

CONFIG = REPO / "tests" / "configs" / "parity_embed.yaml"
TRAIN, DEV = REPO / "data" / "stsb" / "train.parquet", REPO / "data" / "stsb" / "validation.parquet"
MINILM = REPO.parent / "shared" / "models" / "all-minilm-l6-v2"


def _cfg(*overrides: str):
    from finetune.config import load_run_config

    return load_run_config(CONFIG, list(overrides))


def _batch(cfg, rows: list[dict]):
    from transformers import AutoTokenizer

    from finetune.recipes.embed import Tokenize, make_collator

    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    out = Tokenize(tok, cfg.data)(cols)
    return make_collator(tok, cfg.data)([{k: v[i] for k, v in out.items()} for i in range(len(rows))])


def _tiny_bert(dropout: float):
    from transformers import AutoModel, BertConfig

    torch.manual_seed(0)
    config = BertConfig.from_pretrained(REPO / "data" / "models" / "bert-small", hidden_size=64, intermediate_size=128,
                                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return AutoModel.from_config(config)


@pytest.mark.skipif(not MINILM.is_dir(), reason="needs ../shared/models/all-minilm-l6-v2")
def test_pooling_and_loss_are_sentence_transformers():
    """On the real MiniLM folder: the recipe reads mean pooling and normalization from ``modules.json``, pools as
    sentence-transformers does, and its loss is ``MultipleNegativesRankingLoss`` with a hard negative per row, and its
    symmetric form (both directions) on pairs."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from finetune.config import EmbedConfig
    from finetune.recipes.embed import embed, folder_pooling, pair_losses

    assert folder_pooling(MINILM) == ("mean", True)
    rows = pq.read_table(TRAIN).slice(0, 6).to_pylist()
    for i, r in enumerate(rows):
        r["negative"] = rows[(i + 1) % len(rows)]["anchor"]
    cfg = _cfg(f"model.path={MINILM}", "model.tokenizer_path=", "data.negative_column=negative", "data.score_column=",
               "data.max_seq_len=128")
    batch = _batch(cfg, [{k: r[k] for k in ("anchor", "positive", "negative")} for r in rows])
    st = SentenceTransformer(str(MINILM), device="cpu", model_kwargs={"dtype": torch.float32}).eval()
    with torch.no_grad():
        ours = embed(st[0].auto_model, batch, "mean")
        theirs = st.encode([r[k] for k in ("anchor", "positive", "negative") for r in rows], convert_to_tensor=True)
        assert torch.allclose(F.normalize(ours, dim=-1), theirs, atol=1e-5)  # the folder's Normalize module
        b = len(rows)
        want = MultipleNegativesRankingLoss(st).compute_loss_from_embeddings(
            [theirs[:b], theirs[b:2 * b], theirs[2 * b:]], None)
        # the loss on the same embeddings (the pooling was compared above), to a few float32 ulps of the scaled logits
        # (scale 20: one ulp of a logit near 20 is 1.9e-6; two CPUs' kernels sum the log-sum-exp in different orders)
        tol = 20 * torch.finfo(torch.float32).eps * 8
        assert pair_losses(theirs, b, EmbedConfig(), gather=False).mean().item() == pytest.approx(want.item(), abs=tol)
        # the symmetric loss (sentence-transformers 6: MultipleNegativesRankingLoss with both directions, each its own
        # softmax, in place of the deprecated MultipleNegativesSymmetricRankingLoss) on pairs
        symmetric = MultipleNegativesRankingLoss(st, directions=("query_to_doc", "doc_to_query"),
                                                 partition_mode="per_direction")
        want = symmetric.compute_loss_from_embeddings([theirs[:b], theirs[b:2 * b]], None)
        got = pair_losses(theirs[:2 * b], b, EmbedConfig(symmetric=True), gather=False).mean()
        assert got.item() == pytest.approx(want.item(), abs=tol)


def test_gradient_cache_equals_the_plain_loss_with_dropout():
    """One micro-batch, dropout on, a hard negative and the symmetric loss: the gradient cache (a pass without
    gradients, the loss's gradient per embedding, the micro-batch again with it) gives the plain loss and gradients,
    because the second pass draws the first pass's dropout masks."""
    import dataclasses

    from finetune.recipes import get_recipe

    rows = pq.read_table(TRAIN).slice(0, 8).to_pylist()
    for i, r in enumerate(rows):
        r["negative"] = rows[(i + 3) % len(rows)]["positive"]
    cfg = _cfg("data.negative_column=negative", "train.embed.symmetric=true", "train.embed.cached=true")
    batch = _batch(cfg, rows)
    recipe = get_recipe("embed").configure(get_recipe("embed"), cfg)

    def grads(cached: bool, replay: bool = True):
        model = _tiny_bert(dropout=0.1).train()
        rec = recipe if cached else dataclasses.replace(recipe, before_step=lambda e, m, c: m)
        torch.manual_seed(7)
        micro = rec.before_step(model, [dict(batch)], cfg)
        if not replay:  # the check can fail: the second pass then draws other masks than the first
            micro[0]["_rng"].restore = lambda: None
        out = rec.forward(model, micro[0])
        out.loss_sum.backward()
        return out.loss_sum.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (plain_loss, plain), (cached_loss, cached) = grads(False), grads(True)
    assert cached_loss == pytest.approx(plain_loss, rel=1e-6)
    assert len(plain) == len(cached) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(plain, cached))
    unreplayed = grads(True, replay=False)[1]
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(plain, unreplayed))


def test_a_repeated_text_is_no_negative_of_itself():
    """Questions that share their paragraph (SQuAD's form): each anchor's softmax leaves out the other copies of its
    own positive, and with the symmetric loss each positive leaves out the other copies of its own anchor; the loss
    is then that of the candidates with the copies removed. ``mask_duplicates=false``: sentence-transformers' loss."""
    from finetune.config import EmbedConfig
    from finetune.recipes.embed import pair_losses, ranking_losses

    para = pq.read_table(TRAIN).slice(0, 3).to_pylist()
    rows = [{"anchor": f"question {i}?", "positive": para[i % 3]["positive"]} for i in range(6)] + [
        {"anchor": "question 0?", "positive": para[2]["anchor"]}]
    batch = _batch(_cfg("data.score_column="), rows)
    b, key = len(rows), batch["text_key"]
    assert key[b:2 * b].tolist()[:3] == key[b + 3:b + 6].tolist() and len(set(key[b:2 * b].tolist())) == 4
    assert key[0] == key[6] and len(set(key[:b].tolist())) == 6
    torch.manual_seed(0)
    emb = torch.randn(2 * b, 16)
    a, p = emb[:b], emb[b:]

    def without_copies(q, cands, ks, i):  # the plain loss of query i against the candidates left
        keep = [j for j in range(len(cands)) if j == i or ks[j] != ks[i]]
        return ranking_losses(q[i:i + 1], cands[keep], cands[:0], keep.index(i), 20.0)[0]

    want = torch.stack([without_copies(a, p, key[b:].tolist(), i) for i in range(b)])
    torch.testing.assert_close(pair_losses(emb, b, EmbedConfig(), False, key), want)
    back = torch.stack([without_copies(p, a, key[:b].tolist(), i) for i in range(b)])
    torch.testing.assert_close(pair_losses(emb, b, EmbedConfig(symmetric=True), False, key), (want + back) / 2)
    plain = ranking_losses(a, p, p[:0], 0, 20.0)
    torch.testing.assert_close(pair_losses(emb, b, EmbedConfig(), False, None), plain)
    assert bool((plain[:6] > want[:6]).all()) and plain[6].item() == pytest.approx(want[6].item())


def test_short_and_long_texts_run_at_their_own_widths():
    """Short queries beside long passages run as two forwards, each at its own width: the same embeddings and
    gradients as one forward over the batch padded to its longest text."""
    from finetune.data.batch import model_inputs
    from finetune.recipes.common.widths import width_groups
    from finetune.recipes.embed import embed, pool

    rows = pq.read_table(TRAIN).slice(0, 6).to_pylist()
    rows = [{"anchor": r["anchor"].split()[0], "positive": " ".join([r["positive"]] * 4)} for r in rows]
    batch = _batch(_cfg("data.score_column="), rows)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert [len(g) for g, _ in width_groups(lengths)] == [6, 6] and max(lengths[:6]) < min(lengths[6:])

    def run(grouped: bool):
        model = _tiny_bert(dropout=0.0).train()
        emb = embed(model, batch, "mean") if grouped else pool(
            model(**model_inputs(batch)).last_hidden_state, batch["attention_mask"], "mean")
        (emb * torch.linspace(-1, 1, emb.numel()).view_as(emb)).sum().backward()
        return emb.detach(), [p.grad for p in model.parameters() if p.grad is not None]

    (one, one_grads), (two, two_grads) = run(False), run(True)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
    assert len(one_grads) == len(two_grads)
    scale = max(a.abs().max().item() for a in one_grads)  # sums over every position: float32 rounding of that scale
    for a, b in zip(one_grads, two_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * scale)


def test_metrics_are_scipys_and_a_direct_count():
    """``spearman`` equals SciPy's ``spearmanr`` (ties included); MRR@10, NDCG@10 and accuracy@1 equal a direct
    ranking of each query's passage."""
    import numpy as np
    from scipy.stats import spearmanr

    from finetune.recipes.embed import retrieval, spearman

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, generator=g), torch.randint(0, 6, (50,), generator=g).double()
    assert spearman(x, y) == pytest.approx(spearmanr(x.numpy(), y.numpy()).statistic, rel=1e-12)
    q, c = torch.randn(30, 8, generator=g), torch.randn(40, 8, generator=g)
    c[:30] = q + 1.5 * torch.randn(30, 8, generator=g)
    c[30] = c[3] * (1 + 1e-7)  # passage 3 again, a rounding apart: it does not push passage 3 down
    got = retrieval(q, c, torch.arange(30))
    sims = F.cosine_similarity(q[:, None], c[None], dim=-1).numpy()
    sims[3, 30] = -1  # for query 3 it ties with its own passage; for the others it is one more passage
    ranks = np.array([1 + (sims[i] > sims[i, i]).sum() for i in range(30)])
    assert 0 < got["accuracy_at_1"] < 1
    assert got["mrr_at_10"] == pytest.approx(np.mean(np.where(ranks <= 10, 1 / ranks, 0)))
    assert got["ndcg_at_10"] == pytest.approx(np.mean(np.where(ranks <= 10, 1 / np.log2(ranks + 1), 0)))
    assert got["accuracy_at_1"] == pytest.approx(np.mean(ranks == 1))


def test_bad_rows_are_one_line_errors(tmp_path):
    def write(name: str, **cols) -> Path:
        pq.write_table(pa.table(cols), tmp_path / name)
        return tmp_path / name

    blank = write("blank.parquet", anchor=["a cat", "a dog", "x"], positive=["a kitten", " ", "y"],
                  score=[1.0, 0.9, 0.8])
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {blank}]")
    assert str(blank) in err and "row 1 column 'positive' is empty" in err

    high = write("high.parquet", anchor=["a", "b"], positive=["c", "d"], score=[0.5, 4.2])
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {high}]")
    assert "row 1 column 'score' is 4.2" in err and "[0, 1]" in err

    ints = write("ints.parquet", anchor=[1, 2], positive=["c", "d"], score=[0.5, 0.2])
    err = one_refusal(CONFIG, f"data.train_files=[{TRAIN}, {ints}]")
    assert "column 'anchor' holds int64" in err

    errs = refusals(CONFIG, "data.negative_column=hard")  # one line per file
    assert len(errs) == 2 and all("has no column 'hard'" in e for e in errs)

    assert "train.embed.scale: 0.0" in one_refusal(CONFIG, "train.embed.scale=0")
    assert "loss_weighting: token" in one_refusal(CONFIG, "train.embed.cached=true", "train.loss_weighting=micro_batch")


def test_bundle_starts_an_embed_config_for_sentence_transformers_columns(tmp_path):
    """``finetune bundle``'s starting run config: a dataset with sentence-transformers' ``anchor``/``positive``
    (``negative``) columns starts an ``embed`` run on them."""
    from finetune.airgap.bundle import Source, _recipe_guess

    data = Source("dataset", "all-nli", "all-nli",
                  splits={"train": {"rows": 3, "columns": ["anchor", "positive", "negative"]}})
    assert _recipe_guess([], [data], tmp_path) == (
        "embed", {"anchor_column": "anchor", "positive_column": "positive", "negative_column": "negative"})


def test_inspect_shows_each_side_of_a_pair(capsys):
    """``finetune inspect`` shows each row's anchor and positive as texts, the row's label with the anchor."""
    from finetune.commands.inspect import main

    assert main([str(CONFIG), "--rows", "1", "--split", "validation"]) == 0
    shown = capsys.readouterr().out
    assert "row 0 anchor" in shown and "row 0 positive" in shown
    assert "hard hat is dancing" in shown and "label 1" in shown


# ---------------------------------------------------------------------------------------------------------------
# Launched: parity with one device (gathered negatives at ZeRO 0 and 3, the gradient cache), metrics, resume, export
# ---------------------------------------------------------------------------------------------------------------

RUNS = {"z0": ["ds.zero_optimization.stage=0", "export=false"], "z3": ["ds.zero_optimization.stage=3"],
        "cached": ["train.embed.cached=true", "export=false"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lazy_runs(tmp_path_factory.mktemp("embed"), CONFIG, RUNS)


def _reference(cached: bool):
    from sentence_transformers.util import cos_sim

    from finetune.config import load_run_config
    from parity_reference import reference_run

    cfg = load_run_config(CONFIG, [f"data.cache_dir={cpu_env()['FINETUNE_CACHE']}"])
    seen: dict = {}

    def tag(model, micro, step):  # called for rank 0's micro-batches, then rank 1's, of each step
        ranks = seen.setdefault(step, [])
        for k, b in enumerate(micro):
            b["_at"] = (step, len(ranks), k)
        ranks.append(micro)
        return micro

    def loss_sum(model, b):
        step, rank, k = b.pop("_at")
        if rank != 0 or (cached and k != 0):  # the group's loss is taken once, at its first micro-batch
            return torch.zeros((), requires_grad=True)
        ranks = seen[step]
        group = [m for r in ranks for m in r] if cached else [r[k] for r in ranks]
        anchors = [t for m in group for t, pos in zip(_texts(m, 0), m["labels"].tolist()) if pos == 1]
        positives = [t for m in group for t in _texts(m, 1)]
        width = max(len(t) for t in anchors + positives)
        ids = torch.tensor([t + [0] * (width - len(t)) for t in anchors + positives])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in anchors + positives])
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        emb = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        n = len(anchors)
        labels = torch.cat([m["labels"] for m in group]).tolist()
        own = torch.tensor([i for i, pos in enumerate(labels) if pos == 1], dtype=torch.long)
        copies = torch.tensor([[j != i and positives[j] == positives[i] for j in range(len(positives))]
                               for i in own.tolist()], dtype=torch.bool).view(len(own), len(positives))
        seen["copies"] = seen.get("copies", 0) + int(copies.sum())
        logits = (20.0 * cos_sim(emb[:n], emb[n:])).masked_fill(copies, float("-inf"))  # mask_duplicates
        return F.cross_entropy(logits, own, reduction="sum")

    return reference_run(cfg, 2, cfg.train.max_steps, loss_fn=loss_sum, before_step=tag), seen.get("copies", 0)


def _texts(batch: dict, side: int) -> list[list[int]]:
    b = batch["labels"].shape[0]
    rows = range(side * b, (side + 1) * b)
    return [batch["input_ids"][i][batch["attention_mask"][i] == 1].tolist() for i in rows]


@pytest.mark.extended
@pytest.mark.parametrize("stage", ["z0", "z3", "cached"])
def test_embed_matches_one_device(runs, stage):
    """2 ranks x micro 4 x accumulation 2 give one device's losses and grad norms with every anchor against the
    positives of both ranks (gathered), and with the gradient cache against the whole global batch's; at ZeRO 3 the
    exported weights too."""
    # BERT's pooler is no part of an embedding: its gradient is 0, and DeepSpeed's AdamW still decays it
    reference, copies = _reference(stage == "cached")
    assert copies > 0  # an anchor's positive repeats in its group (seed 2): mask_duplicates leaves the copy out
    assert_one_device(runs(stage), reference, stage == "z3", "embeddings.word_embeddings.weight",
                      skip=("pooler.dense.weight", "pooler.dense.bias"))


@pytest.mark.extended
def test_metrics_resume_and_export_are_sentence_transformers(runs, tmp_path):
    """The step-0 evaluation (both ranks' rows together) equals sentence-transformers' embeddings of the initial
    weights scored directly; a resume from step 3 repeats steps 4-6; ``SentenceTransformer`` loads the export and
    embeds as the engine's final weights do (its step-6 evaluation)."""
    from scipy.stats import spearmanr
    from sentence_transformers import SentenceTransformer

    from conftest import scratch_model
    from finetune.recipes.embed import retrieval

    run = runs("z3")
    dev = pq.read_table(DEV).to_pylist()
    score = torch.tensor([r["score"] for r in dev])
    queries = torch.nonzero(score >= 0.8).flatten()

    def metrics(encode) -> dict:
        a, p = encode([r["anchor"] for r in dev]), encode([r["positive"] for r in dev])
        out = retrieval(a[queries], p, queries)
        out["spearman"] = spearmanr(F.cosine_similarity(a, p).numpy(), score.numpy()).statistic
        return out

    model = scratch_model(_cfg()).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "models" / "bert-base-uncased-tokenizer")

    def encode_initial(texts):
        with torch.no_grad():
            enc = tok(texts, truncation=True, max_length=32, padding=True, return_tensors="pt")
            h = model(**enc).last_hidden_state
            m = enc["attention_mask"][..., None]
            return (h * m).sum(1) / m.sum(1)

    def close(got: dict, want: dict) -> None:
        # a random model's embeddings crowd together: rankings among 1,500 passages swap with the padding width
        # (float32 rounding), so retrieval agrees to 0.01
        for name, value in want.items():
            assert got[f"eval/{name}"] == pytest.approx(value, **({"rel": 1e-4} if name == "spearman" else
                                                                  {"abs": 0.01})), name

    logged = {r["step"]: r for r in read_metrics(run) if "eval/spearman" in r}
    close(logged[0], metrics(encode_initial))

    st = SentenceTransformer(str(run / "export"), device="cpu", model_kwargs={"dtype": torch.float32})
    assert st.max_seq_length == 32 and st[1].pooling_mode == "mean"
    final = metrics(lambda texts: st.encode(texts, convert_to_tensor=True, batch_size=64))
    close(logged[max(logged)], final)
    assert final["spearman"] != pytest.approx(logged[0]["eval/spearman"], rel=1e-3)  # it trained

    assert_resume_repeats(CONFIG, RUNS["z3"], run, tmp_path / "resumed")
