import json

import pytest

from dptrain.accounting import PrivacyLedger, PrivateSteps


def test_consecutive_identical_steps_merge_and_changes_are_kept():
    ledger = PrivacyLedger()
    for _ in range(3):
        ledger.record(0.01, 1.0)
    ledger.record(0.02, 1.0, count=5)  # batch size doubled
    ledger.record(0.02, 1.0)
    ledger.record(0.01, 1.0)  # back to the first rate: a new segment, not merged far back
    assert ledger.segments == (
        PrivateSteps(0.01, 1.0, 3),
        PrivateSteps(0.02, 1.0, 6),
        PrivateSteps(0.01, 1.0, 1),
    )
    assert ledger.num_steps == 10
    assert len(ledger) == 3


def test_noise_schedule_starts_new_segment():
    ledger = PrivacyLedger()
    ledger.record(0.01, 1.0)
    ledger.record(0.01, 1.5)
    assert [s.noise_multiplier for s in ledger.segments] == [1.0, 1.5]


def test_json_and_state_dict_round_trip():
    ledger = PrivacyLedger(privacy_unit="user")
    ledger.record(0.004, 1.1, 100)
    ledger.record(0.016, 1.1, 50)
    again = PrivacyLedger.from_json(ledger.to_json())
    assert again == ledger
    assert again.privacy_unit == "user"
    state = json.loads(json.dumps(ledger.state_dict()))
    restored = PrivacyLedger()
    restored.load_state_dict(state)
    assert restored == ledger
    # A resumed run appends to the same ledger.
    restored.record(0.016, 1.1, 1)
    assert restored.segments[-1].count == 51


def test_copy_is_independent():
    ledger = PrivacyLedger.from_schedule([(0.1, 2)], 1.0)
    clone = ledger.copy()
    clone.record(0.1, 1.0)
    assert ledger.num_steps == 2 and clone.num_steps == 3


def test_from_schedule_skips_empty_segments():
    ledger = PrivacyLedger.from_schedule([(0.1, 0), (0.2, 3)], 2.0)
    assert ledger.segments == (PrivateSteps(0.2, 2.0, 3),)


def test_unknown_format_version_is_refused():
    state = PrivacyLedger().state_dict()
    state["format_version"] = 99
    with pytest.raises(ValueError, match=r"format_version=99 is not supported: expected 1"):
        PrivacyLedger.from_state_dict(state)


def test_autosave_keeps_the_file_equal_to_the_ledger_after_every_change(tmp_path):
    """A run stopped at any point leaves its ledger on disk: written at once, after every
    record and after a restore, atomically (no temporary file left); copies do not write."""
    path = tmp_path / "run" / "ledger.json"
    ledger = PrivacyLedger(privacy_unit="user")
    ledger.autosave(path)
    assert PrivacyLedger.from_json(path.read_text()) == ledger  # empty, but there
    for k in range(3):
        ledger.record(0.01, 1.1)
        assert PrivacyLedger.from_json(path.read_text()).num_steps == k + 1
    ledger.record(0.02, 1.1, count=5)
    assert PrivacyLedger.from_json(path.read_text()) == ledger
    copy = ledger.copy()
    copy.record(0.5, 0.5)
    assert PrivacyLedger.from_json(path.read_text()) == ledger  # the copy did not write
    other = PrivacyLedger()
    other.record(0.1, 2.0, 7)
    ledger.load_state_dict(other.state_dict())
    assert PrivacyLedger.from_json(path.read_text()).num_steps == 7
    assert [p.name for p in path.parent.iterdir()] == ["ledger.json"]


def test_a_deep_copy_of_an_autosaving_ledger_does_not_write_its_file(tmp_path):
    import copy

    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger()
    ledger.autosave(path)
    clone = copy.deepcopy(ledger)
    clone.record(0.1, 1.0)
    assert PrivacyLedger.from_json(path.read_text()).num_steps == 0
