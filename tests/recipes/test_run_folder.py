"""Where runs are written: a folder the user named is never written over without
``overwrite=true``; a default folder that holds a run gives way to a fresh sibling."""

from __future__ import annotations

import re

import pytest

from dptrain.recipes._run_folder import check_run_folder, claim_run_folder


def _earlier_run(folder):
    folder.mkdir(parents=True)
    (folder / "ledger.json").write_text("{}")
    return folder


def test_a_named_folder_that_holds_a_run_is_refused(tmp_path):
    old = _earlier_run(tmp_path / "demo")
    with pytest.raises(ValueError, match=r"out='.*demo' is not allowed: the folder exists"):
        claim_run_folder(old, named=True, overwrite=False)
    assert [p.name for p in old.iterdir()] == ["ledger.json"]


def test_a_named_folder_that_is_new_or_empty_is_used(tmp_path):
    assert claim_run_folder(tmp_path / "new", named=True, overwrite=False) == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert claim_run_folder(tmp_path / "empty", named=True, overwrite=False) == tmp_path / "empty"


def test_a_default_folder_that_holds_a_run_gives_way_to_a_fresh_sibling(tmp_path, capsys):
    old = _earlier_run(tmp_path / "demo")
    fresh = claim_run_folder(old, named=False, overwrite=False)
    assert fresh.parent == tmp_path and re.fullmatch(r"demo-\d{8}-\d{6}", fresh.name)
    assert not fresh.exists()  # the command makes it when it writes
    err = capsys.readouterr().err
    assert str(old) in err and str(fresh) in err and "never overwritten" in err
    # a second claim in the same second (the first one's folder now made) gets its own
    fresh.mkdir()
    again = claim_run_folder(old, named=False, overwrite=False)
    assert again != fresh and not again.exists() and again.parent == tmp_path
    assert [p.name for p in old.iterdir()] == ["ledger.json"]


def test_a_default_folder_without_a_run_is_used(tmp_path):
    assert claim_run_folder(tmp_path / "demo", named=False, overwrite=False) == tmp_path / "demo"


def test_overwrite_true_writes_over_the_folder_named_or_not(tmp_path):
    old = _earlier_run(tmp_path / "demo")
    assert claim_run_folder(old, named=True, overwrite=True) == old
    assert claim_run_folder(old, named=False, overwrite=True) == old


def test_inside_checks_the_subfolder_the_command_writes(tmp_path):
    # one config serving several studies: out/snr holds a run, out/weight-decay does not
    _earlier_run(tmp_path / "studies" / "snr")
    out = tmp_path / "studies"
    assert claim_run_folder(out, named=True, overwrite=False, inside="weight-decay") == out
    with pytest.raises(ValueError, match="the folder exists"):
        claim_run_folder(out, named=True, overwrite=False, inside="snr")
    assert claim_run_folder(out, named=False, overwrite=False, inside="snr").name.startswith(
        "studies-"
    )


def test_a_file_where_the_folder_should_be_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    for named, overwrite in ((True, False), (False, False), (True, True)):
        with pytest.raises(ValueError, match="it is a file"):
            claim_run_folder(tmp_path / "f", named=named, overwrite=overwrite)
    with pytest.raises(ValueError, match="it is a file"):
        check_run_folder(tmp_path / "f", True)
