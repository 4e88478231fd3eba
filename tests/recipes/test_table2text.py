"""Table-to-text recipe: loss masking (oracle), log-likelihoods, scoring, bad input, smoke runs.

Everything runs on tiny synthetic E2E-like files in tmp_path (no /work/shared).
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import transformers

from dptrain.cli import _TRAIN_RECIPES
from dptrain.clipping import ClippingEngine
from dptrain.data.e2e import E2E_FILES
from dptrain.data.tokenizer import train_tokenizer
from dptrain.privacy_record import read as read_record
from dptrain.recipes.table2text import (
    Table2TextConfig,
    _losses,
    decode,
    encode_pairs,
    fit_table2text,
    group_references,
    linearize_table,
    score_generations,
    text_log_likelihood,
    train_table2text,
)

NAMES = ["Alimentum", "Aromi", "Cotto", "Zizzi", "Wildwood", "Loch Fyne", "Strada", "Giraffe"]
AREAS = ["city centre", "riverside"]
TYPES = ["pub", "restaurant", "coffee shop"]


def synthetic_pairs(n_tables: int, refs: int, offset: int = 0) -> list[tuple[str, str]]:
    pairs = []
    for i in range(n_tables):
        name = NAMES[(i + offset) % len(NAMES)]
        area = AREAS[(i + offset) % 2]
        kind = TYPES[(i + offset) % 3]
        table = f"name[{name}], eatType[{kind}], area[{area}], near[{NAMES[(i + 3) % 8]} {i}]"
        texts = [
            f"{name} is a {kind} in the {area}.",
            f"In the {area} there is a {kind} called {name}.",
            f"{name} is a {kind} near {NAMES[(i + 3) % 8]} {i}.",
        ]
        pairs += [(table, texts[j % 3]) for j in range(refs)]
    return pairs


def write_e2e(folder, dev, test):
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in ((E2E_FILES["dev"], dev), (E2E_FILES["test"], test)):
        with (folder / name).open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["mr", "ref", "fixed", "orig_mr"])
            writer.writerows([t, x, 0, t] for t, x in rows)
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    pairs = synthetic_pairs(12, 3)
    return train_tokenizer(
        [linearize_table(t) for t, _ in pairs] + [x for _, x in pairs], vocab_size=120
    )


def tiny_model(tokenizer, dtype=torch.float64, n_positions=64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg).to(dtype).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: phantom clipping
    return model


def tiny_config(tmp_path, data, **kw) -> Table2TextConfig:
    values = dict(
        data=str(data),
        valid_fraction=0.25,
        vocab_size=100,
        n_layer=1,
        n_embd=16,
        n_head=2,
        max_len=48,
        epochs=2,
        batch_size=8,
        lr=3e-3,
        max_physical_batch_size=8,
        beam_size=2,
        max_new_tokens=12,
        max_test_tables=3,
        max_valid_tables=2,
        n_samples=2,
        progress=False,
        out=str(tmp_path / "run"),
    )
    values.update(kw)
    return Table2TextConfig(**values)


# -- format and masking ---------------------------------------------------------------------------


def test_linearize_table():
    got = linearize_table("name[The Punter], priceRange[£20-25], customer rating[3 out of 5]")
    assert got == "name : The Punter | priceRange : £20-25 | customer rating : 3 out of 5"
    assert linearize_table("a plain table") == "a plain table"
    assert linearize_table("a[b], stray text") == "a[b], stray text"  # not all key[value]: kept


def test_encode_pairs_places_the_labels_on_the_text_and_eos_only(tokenizer):
    pairs = synthetic_pairs(3, 1)
    enc = encode_pairs(tokenizer, pairs, max_len=64)
    ids, mask, labels = enc["input_ids"], enc["attention_mask"], enc["labels"]
    assert ids.shape == mask.shape == labels.shape
    bos, sep, eos = tokenizer.bos_token_id, tokenizer.sep_token_id, tokenizer.eos_token_id
    for i, (table, text) in enumerate(pairs):
        t_ids = tokenizer(linearize_table(table), add_special_tokens=False)["input_ids"]
        x_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        want = [bos, *t_ids, sep, *x_ids, eos]
        n = len(want)
        assert ids[i, :n].tolist() == want
        assert mask[i].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        assert (ids[i, n:] == tokenizer.pad_token_id).all()
        start = len(t_ids) + 2
        assert (labels[i, :start] == -100).all()  # [BOS], table, [SEP]
        assert labels[i, start:n].tolist() == [*x_ids, eos]
        assert (labels[i, n:] == -100).all()  # padding
    assert tokenizer.decode(ids[0, mask[0].bool()]).startswith("[BOS]")


def test_encode_pairs_truncates_at_max_len(tokenizer):
    pairs = synthetic_pairs(2, 1)
    full = encode_pairs(tokenizer, pairs, max_len=64)
    cut = encode_pairs(tokenizer, pairs, max_len=12)
    assert cut["input_ids"].shape[1] == 12
    assert torch.equal(cut["input_ids"], full["input_ids"][:, :12])
    assert torch.equal(cut["labels"], full["labels"][:, :12])


def _reference_text_logp(model, tokenizer, table, text, with_eos):
    """log p of the text tokens (and [EOS]) given the table, from the unpadded sequence alone."""
    t_ids = tokenizer(linearize_table(table), add_special_tokens=False)["input_ids"]
    x_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq = [tokenizer.bos_token_id, *t_ids, tokenizer.sep_token_id, *x_ids, tokenizer.eos_token_id]
    logits = model(input_ids=torch.tensor([seq])).logits[0]
    logp = torch.log_softmax(logits.double(), -1)
    start = len(t_ids) + 2
    stop = len(seq) if with_eos else len(seq) - 1
    terms = torch.stack([logp[t - 1, seq[t]] for t in range(start, stop)])
    return terms  # one term per text token (+ [EOS])


def test_masked_loss_matches_the_unpadded_oracle_and_padding_is_inert(tokenizer):
    model = tiny_model(tokenizer)
    pairs = synthetic_pairs(4, 1)
    enc = encode_pairs(tokenizer, pairs, max_len=64)
    losses = _losses(model, enc["input_ids"], enc["attention_mask"], enc["labels"], "mean")
    want = torch.stack(
        [-_reference_text_logp(model, tokenizer, t, x, True).mean() for t, x in pairs]
    )
    assert torch.allclose(losses, want, rtol=1e-10, atol=1e-12)
    # padding ids replaced by arbitrary tokens: same losses (right padding, masked labels)
    ids = enc["input_ids"].clone()
    pad = enc["attention_mask"] == 0
    assert pad.any()
    ids[pad] = torch.randint(5, len(tokenizer), (int(pad.sum()),))
    again = _losses(model, ids, enc["attention_mask"], enc["labels"], "mean")
    assert torch.allclose(again, losses, rtol=0, atol=1e-12)
    # the check can fail: labelling the table too changes the loss
    labels = torch.where(enc["attention_mask"].bool(), enc["input_ids"], -100)
    wrong = _losses(model, enc["input_ids"], enc["attention_mask"], labels, "mean")
    assert not torch.allclose(wrong, losses, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_engine_clipped_sum_equals_batch_one_oracle_on_unpadded_sequences(tokenizer, reduction):
    """The engine on the padded batch = per-example grads of the text-only loss, clipped."""
    model = tiny_model(tokenizer)
    pairs = synthetic_pairs(5, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    grads, norms = [], []
    for table, text in pairs:
        terms = _reference_text_logp(model, tokenizer, table, text, True)
        loss = -(terms.mean() if reduction == "mean" else terms.sum())
        g = torch.autograd.grad(loss, params)
        grads.append(g)
        norms.append(torch.sqrt(sum((x.double() ** 2).sum() for x in g)))
    norms_t = torch.stack(norms)
    c = float(norms_t.median())
    factors = torch.clamp(c / norms_t, max=1.0)
    want = [sum(f * g[k] for f, g in zip(factors, grads, strict=True)) for k in range(len(params))]

    enc = encode_pairs(tokenizer, pairs, max_len=64)
    engine = ClippingEngine(model, c, clipping="flat", mode="book_keeping")
    try:
        stats = engine.backward(
            _losses(model, enc["input_ids"], enc["attention_mask"], enc["labels"], reduction)
        )
    finally:
        engine.detach()
    assert torch.allclose(stats.norms.double(), norms_t, rtol=1e-9)
    for p, w in zip(params, want, strict=True):
        assert torch.allclose(p.grad, w, rtol=1e-8, atol=1e-12)
    model.zero_grad(set_to_none=True)


def test_text_log_likelihood_sums_the_text_tokens_without_eos(tokenizer):
    model = tiny_model(tokenizer, dtype=torch.float32, n_positions=128)
    pairs = synthetic_pairs(5, 2)
    # no sequence is cut at max_len, so the reference (never truncated) is the same quantity
    assert encode_pairs(tokenizer, pairs, max_len=128)["attention_mask"].sum(1).max() < 128
    got = text_log_likelihood(model, tokenizer, pairs, max_len=128, batch_size=3)
    assert got.dtype == torch.float64 and got.shape == (10,)
    with torch.no_grad():
        want = torch.stack(
            [_reference_text_logp(model, tokenizer, t, x, False).sum() for t, x in pairs]
        )
    assert torch.allclose(got, want, rtol=1e-5)
    assert torch.allclose(
        got, text_log_likelihood(model, tokenizer, pairs, max_len=128, batch_size=64), rtol=1e-6
    )
    assert (got < 0).all()
    model.train()
    text_log_likelihood(model, tokenizer, pairs[:1], max_len=64)
    assert model.training  # the mode is restored


# -- decoding and scoring --------------------------------------------------------------------------


def test_scores_on_known_cases():
    refs = [["the cat sat on the mat", "a cat was on a mat"], ["Aromi is a pub."]]
    perfect = score_generations(["a cat was on a mat", "Aromi is a pub."], refs)
    assert perfect["bleu"] == pytest.approx(100.0)
    assert perfect["rouge_l"] == pytest.approx(100.0)
    # ROUGE-L: LCS 3 of 4 tokens each way -> F = 0.75 against the best reference
    one = score_generations(["a b c d"], [["x y z w", "a b e d"]])
    assert one["rouge_l"] == pytest.approx(75.0)
    assert 0.0 <= one["bleu"] < 100.0
    with pytest.raises(ValueError, match="differ in length"):
        score_generations(["a"], [])
    with pytest.raises(ValueError, match="at least one reference"):
        score_generations(["a"], [[]])


def test_group_references_keeps_first_seen_order():
    pairs = [("b", "1"), ("a", "2"), ("b", "3")]
    assert group_references(pairs) == [("b", ["1", "3"]), ("a", ["2"])]


@pytest.mark.parametrize("batching", ["by_length", "left_padded"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_decode_matches_a_manual_argmax_loop(tokenizer, tmp_path, batching, arch):
    if arch == "gpt2":
        model = tiny_model(tokenizer, dtype=torch.float32, n_positions=96)
    else:  # rotary positions: left padding must not shift them
        from tests.lm_helpers import save_tiny_llama

        folder = save_tiny_llama(tmp_path / "llama", tokenizer, seed=1)
        model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    tables = [t for t, _ in group_references(synthetic_pairs(6, 1))]
    lengths = {len(tokenizer(linearize_table(t))["input_ids"]) for t in tables}
    assert len(lengths) > 1  # batches mix prompt lengths under left padding
    got = decode(
        model, tokenizer, tables, num_beams=1, max_new_tokens=5, batch_size=4, batching=batching
    )
    for table, text in zip(tables, got, strict=True):
        ids = tokenizer(linearize_table(table), add_special_tokens=False)["input_ids"]
        seq = [tokenizer.bos_token_id, *ids, tokenizer.sep_token_id]
        new = []
        with torch.no_grad():
            for _ in range(5):
                nxt = int(model(input_ids=torch.tensor([seq + new])).logits[0, -1].argmax())
                if nxt == tokenizer.eos_token_id:
                    break
                new.append(nxt)
        assert text == tokenizer.decode(new, skip_special_tokens=True).strip()
    beams = decode(model, tokenizer, tables, num_beams=2, max_new_tokens=5, batching=batching)
    assert len(beams) == 6 and all(isinstance(s, str) for s in beams)


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"epsilon": -1.0}, "epsilon=-1.0"),
        ({"delta": "1/N"}, "delta='1/N'"),
        ({"n_embd": 10, "n_head": 4}, "n_embd=10"),
        ({"loss_reduction": "max"}, "loss_reduction='max'"),
        ({"init_from": "/no/such/folder"}, "init_from='/no/such/folder'"),
        ({"max_len": 2}, "max_len=2"),
        ({"amp": "fp16"}, "amp='fp16' is not allowed: expected one of off, bf16"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        Table2TextConfig(**kw)


def test_bad_data_and_batch(tmp_path):
    with pytest.raises(ValueError, match="data=PATH"):
        train_table2text(tiny_config(tmp_path, tmp_path / "absent"))
    data = write_e2e(tmp_path / "e2e", synthetic_pairs(8, 3), synthetic_pairs(3, 2, 5))
    with pytest.raises(ValueError, match=r"batch_size=500 is not allowed.*only 18 pairs"):
        train_table2text(tiny_config(tmp_path, data, batch_size=500))
    assert not (tmp_path / "run").exists()  # nothing written before the checks pass
    with open(data / E2E_FILES["test"], "w") as f:
        f.write("table,text\na,b\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) 'mr' \(table_col\)"):
        train_table2text(tiny_config(tmp_path, data))


# -- smoke runs ------------------------------------------------------------------------------------


def test_private_run_writes_the_run_folder(tmp_path):
    data = write_e2e(tmp_path / "e2e", synthetic_pairs(16, 3), synthetic_pairs(5, 2, 3))
    # RDP calibration: PLD at q = 0.22 costs seconds per evaluation (results still list PLD)
    cfg = tiny_config(tmp_path, data, epsilon=8.0, accountant="rdp")
    res = train_table2text(cfg)
    # the figures `dptrain train table2text` prints are in the results
    assert set(_TRAIN_RECIPES["table2text"][3]) <= set(res)
    out = tmp_path / "run"
    for name in (
        "config.yaml",
        "data.json",
        "ledger.json",
        "metrics.jsonl",
        "results.json",
        "generations.jsonl",
        "samples.md",
        "plots/loss.png",
        "plots/epsilon.png",
        "tokenizer/tokenizer.json",
        "model/config.json",
    ):
        assert (out / name).is_file(), name
    assert json.loads((out / "results.json").read_text()) == res
    assert "audit" not in res  # audit=false (the default)
    n = res["n_train_pairs"]
    assert n == 36  # 12 of 16 tables (valid_fraction 0.25) x 3 references
    assert res["steps"] == math.ceil(2 / (8 / n))
    ledger = json.loads((out / "ledger.json").read_text())
    assert sum(seg["count"] for seg in ledger["segments"]) == res["steps"]
    # the privacy record, in the run and beside the saved model
    record = read_record(out / "model")
    assert record == read_record(out) and record.producer == "dptrain train table2text"
    assert (record.epsilon, record.delta, record.accountant) == (
        res["epsilon"],
        res["delta"],
        "rdp",
    )
    assert record.ledger == ledger
    assert res["delta"] == pytest.approx(1 / (2 * n))
    assert 7.0 < res["epsilon"] <= 8.0 * 1.001
    assert set(res["epsilon_by_accountant"]) >= {"pld", "rdp"}
    assert res["test_tables_decoded"] == 3 and res["test_tables_total"] == 5
    for key in ("test_bleu_greedy", "test_bleu_beam", "test_rouge_l_greedy", "test_rouge_l_beam"):
        assert 0.0 <= res[key] <= 100.0
    assert res["valid_tables_decoded"] == 2 and "valid_bleu_beam" in res
    assert res["gradient_snr_first30"] > 0
    assert "NOT covered" in res["tokenizer_scope"]
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and set(rows[0]) == {"table", "greedy", "beam", "references"}
    assert len(rows[0]["references"]) == 2
    epochs = [
        json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert epochs == [1, 2]
    assert "dev set" in json.loads((out / "data.json").read_text())["source"]


def test_nonprivate_fit_keeps_the_best_epoch(tmp_path):
    data = write_e2e(tmp_path / "e2e", synthetic_pairs(16, 3), synthetic_pairs(5, 2, 3))
    from dptrain.data.e2e import load_e2e

    splits = load_e2e(str(data), valid_fraction=0.25)
    cfg = tiny_config(tmp_path, data, epsilon=None, epochs=3, lr=1e-2)
    fitted = fit_table2text(cfg, splits.train, splits.valid, tmp_path / "fit")
    assert fitted.ledger is None and fitted.epsilon is None and fitted.noise_multiplier is None
    assert not fitted.model.training
    losses = [h["valid_loss"] for h in fitted.history]
    assert len(losses) == 3 and fitted.best_epoch == 1 + losses.index(min(losses))
    assert losses[-1] < losses[0]  # it learns
    enc = encode_pairs(fitted.tokenizer, splits.valid, cfg.max_len)
    from dptrain.recipes.table2text import _valid_loss

    assert _valid_loss(fitted.model, enc, 7) == pytest.approx(min(losses), rel=1e-5)


def test_init_from_a_local_checkpoint(tmp_path, tokenizer):
    folder = tmp_path / "ckpt"
    model = tiny_model(tokenizer, dtype=torch.float32)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    pairs = synthetic_pairs(8, 2)
    cfg = Table2TextConfig(
        init_from=str(folder),
        epsilon=None,
        epochs=1,
        batch_size=4,
        lr=1e-12,  # the loaded weights are (numerically) kept
        max_len=48,
        progress=False,
    )
    fitted = fit_table2text(cfg, pairs[:12], pairs[12:], tmp_path / "fit")
    assert len(fitted.tokenizer) == len(tokenizer)  # the checkpoint's tokenizer
    assert not (tmp_path / "fit" / "tokenizer").exists()
    for (name, p), q in zip(
        fitted.model.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.allclose(p, q, atol=1e-8), name


def test_packaged_config_loads():
    from dptrain.config import load_config
    from dptrain.recipes import configs_dir

    cfg = load_config(Table2TextConfig, configs_dir() / "table2text.yaml", ["epsilon=null"])
    assert cfg.max_grad_norm == 0.1 and cfg.delta == "1/(2N)" and cfg.beam_size == 5
    assert not cfg.private and cfg.tokenizer == "train"


# -- a pretrained causal LM (a tiny Llama folder standing in for SmolLM2) ----------------------


def test_bf16_autocast_trains_close_to_float32(tmp_path):
    from tests.lm_helpers import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "llama")
    data = write_e2e(tmp_path / "e2e", synthetic_pairs(16, 3), synthetic_pairs(5, 2, 3))
    res = {}
    for amp in ("off", "bf16"):
        cfg = tiny_config(
            tmp_path / amp,
            data,
            epsilon=8.0,
            pretrained=str(folder),
            lora_r=4,
            amp=amp,
            max_len=256,
        )
        res[amp] = train_table2text(cfg)
    assert res["bf16"]["amp"] == "bf16"
    off, bf16 = res["off"]["valid_loss"], res["bf16"]["valid_loss"]
    assert off != bf16  # the forward passes did run in bf16
    assert abs(off - bf16) < 0.05 * off  # ~3 significant digits per operation
    assert res["bf16"]["epsilon"] == res["off"]["epsilon"]  # the same ledger


@pytest.mark.parametrize("lora_r", [0, 4])
def test_pretrained_llama_full_and_lora(tmp_path, lora_r):
    from tests.lm_helpers import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "llama")
    data = write_e2e(tmp_path / "e2e", synthetic_pairs(16, 3), synthetic_pairs(5, 2, 3))
    cfg = tiny_config(
        tmp_path,
        data,
        epsilon=8.0,
        accountant="rdp",
        pretrained=str(folder),
        lora_r=lora_r,
        max_len=256,  # the tiny Llama's byte-level tokens: 48 cut every text away
    )
    res = train_table2text(cfg)
    out = tmp_path / "run"
    assert res["n_train_truncated"] == 0 and res["valid_loss"] > 0  # texts were trained on
    assert res["model"] == str(folder) and res["lora_r"] == lora_r
    assert 7.0 < res["epsilon"] <= 8.0 * 1.001
    assert "pretrained model's own tokenizer" in res["tokenizer_scope"]
    assert not (out / "tokenizer").exists()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    # no row added to the pretrained embedding: the end-of-text token separates
    assert res["vocab_size"] == len(tok)
    if lora_r:
        assert res["n_trainable_parameters"] < res["n_parameters"] / 2
        assert (out / "model" / "adapter_config.json").is_file()
    else:
        assert res["n_trainable_parameters"] == res["n_parameters"]
        assert (out / "model" / "config.json").is_file()


@pytest.mark.parametrize("path", ["scratch", "pretrained", "pretrained-lora"])
def test_audit_section_in_results(tmp_path, path):
    """Every private path of fit_table2text: a GPT-2 from the config, a pretrained causal
    LM trained whole (its tied embedding by phantom clipping) and its LoRA adapters."""
    from tests.lm_helpers import save_tiny_llama

    data = write_e2e(tmp_path / "e2e", synthetic_pairs(16, 3), synthetic_pairs(5, 2, 3))
    model = {}
    if path != "scratch":
        model = {"pretrained": str(save_tiny_llama(tmp_path / "llama"))}
        model["lora_r"] = 4 if path == "pretrained-lora" else 0
    cfg = tiny_config(
        tmp_path,
        data,
        epsilon=8.0,
        accountant="rdp",  # fast calibration, as above
        audit=True,
        audit_canaries=1500,
        decode_test=False,
        max_valid_tables=0,
        save_checkpoint=False,
        **model,
    )
    res = train_table2text(cfg)
    audit = res["audit"]
    assert audit["canaries"] == 1500 < res["n_trainable_parameters"]
    assert audit["steps_observed"] == res["steps"]
    assert set(audit["lower_bounds"]) == {"steinke2023"}  # Poisson steps: not Gaussian
    assert not audit["flagged"] and audit["claimed_epsilon"] == res["epsilon"]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["audit"] == audit


def test_audit_bad_config():
    with pytest.raises(
        ValueError, match=r"audit=true is not allowed with a non-private run \(epsilon=null\)"
    ):
        Table2TextConfig(epsilon=None, audit=True)
    with pytest.raises(ValueError, match="audit_canaries=0 is not allowed"):
        Table2TextConfig(audit=True, audit_canaries=0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"lora_r": 4}, "lora_r=4 is not allowed without pretrained="),
        ({"num_layers": 1}, "num_layers=1 is not allowed without pretrained="),
        ({"pretrained": "/no/such/folder"}, "pretrained='/no/such/folder'"),
        (
            {"pretrained": "smollm2-135m-instruct", "tokenizer": "train"},
            "tokenizer='train' is not allowed with pretrained=",
        ),
        ({"pretrained": "smollm2-135m-instruct", "lora_r": 4, "lora_targets": ()}, "lora_targets"),
    ],
)
def test_bad_pretrained_config(kw, match):
    with pytest.raises(ValueError, match=match):
        Table2TextConfig(**kw)


def test_a_device_this_machine_lacks_is_named_by_the_cli(tmp_path, capsys):
    """Refused with exit 2 before the data or a model are read; nothing is written."""
    from dptrain.cli import main

    data = write_e2e(tmp_path / "e2e", synthetic_pairs(8, 3), synthetic_pairs(3, 2, 5))
    code = main(["train", "table2text", f"data={data}", "device=cuda:99", f"out={tmp_path / 'r'}"])
    assert code == 2
    assert "device='cuda:99' is not available here" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
